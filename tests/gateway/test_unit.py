"""Gateway pieces without a network: routing policies and decisions, discovery vetting, stop strings."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.records import NodeLoad
from kvrelay.common.wire import TokenChunk
from kvrelay.gateway.discovery import Discovery, DiscoveryConfig, Node
from kvrelay.gateway.errors import BadRequest, NoCapacity
from kvrelay.gateway.node_client import NodeClients
from kvrelay.gateway.outputs import ChoiceOutput, OutputOptions, TokenTexts
from kvrelay.gateway.policies import make_policy
from kvrelay.gateway.router import Router

MODEL, BS = "m", 16


def node(node_id: str, role: str, load: NodeLoad | None = None, **kw) -> Node:
    return Node(node_id=node_id, role=role, address=f"{node_id}:1", model_id=kw.pop("model_id", MODEL),
                block_size=kw.pop("block_size", BS), source="registry", load=load, **kw)


class FakeDiscovery(Discovery):
    def __init__(self, nodes: list[Node]) -> None:
        super().__init__(DiscoveryConfig(model_id=MODEL, block_size=BS), NodeClients())
        self._registered = {n.node_id: self._vet(n) for n in nodes}


class FakeIndex:
    def __init__(self, holdings: dict[str, list[bytes]] | None = None, fail: bool = False) -> None:
        self.holdings, self.fail, self.calls = holdings or {}, fail, 0

    def lookup(self, hashes, nodes=None):
        self.calls += 1
        if self.fail:
            raise ConnectionError("redis down")
        out = {}
        for node_id, held in self.holdings.items():
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                out[node_id] = n
        return out


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 40000 for i in range(n)]


def route(router: Router, tokens: list[int]):
    return asyncio.run(router.route(tokens))


def fleet(prefill=3, decode=2, loads: dict[str, NodeLoad] | None = None) -> list[Node]:
    loads = loads or {}
    return ([node(f"p{i}", "prefill", loads.get(f"p{i}")) for i in range(prefill)]
            + [node(f"d{i}", "decode", loads.get(f"d{i}")) for i in range(decode)])


def test_cache_aware_goes_where_the_prefix_is():
    tokens = prompt(1, 400)
    hashes = prompt_block_hashes(tokens, MODEL, BS)
    index = FakeIndex({"p2": hashes[:20], "p0": hashes[:3], "d1": hashes[:20]})
    router = Router(FakeDiscovery(fleet()), make_policy("cache_aware"), index, local_prefill_threshold=16)
    d = route(router, tokens)
    assert (d.prefill.node_id, d.decode.node_id) == ("p2", "d1")
    assert d.prefill_cached_tokens == 320 and d.decode_cached_tokens == 320
    assert index.calls == 1  # one round trip per request
    assert [n.node_id for n in d.prefill_fallbacks] == ["p0", "p1"]


def test_local_prefill_when_the_decode_node_holds_almost_all():
    tokens = prompt(2, 330)
    hashes = prompt_block_hashes(tokens, MODEL, BS)
    router = Router(FakeDiscovery(fleet()), make_policy("cache_aware"), FakeIndex({"d0": hashes}), 16)
    d = route(router, tokens)
    assert d.local_prefill and d.decode.node_id == "d0" and d.decode_cached_tokens == 320
    no_prefill = Router(FakeDiscovery(fleet(prefill=0)), make_policy("cache_aware"), FakeIndex(), 16)
    assert route(no_prefill, prompt(3, 500)).local_prefill


def test_load_outweighs_a_short_prefix():
    tokens = prompt(4, 400)
    hashes = prompt_block_hashes(tokens, MODEL, BS)
    loads = {"p0": NodeLoad(queued_prefill_tokens=5000)}
    router = Router(FakeDiscovery(fleet(loads=loads)), make_policy("cache_aware"), FakeIndex({"p0": hashes[:4]}), 16)
    assert route(router, tokens).prefill.node_id != "p0"
    # this gateway's own in-flight prefill tokens count as load before the node publishes them
    router = Router(FakeDiscovery(fleet()), make_policy("cache_aware"), FakeIndex({"p0": hashes[:4]}), 16)
    with router.track_prefill("p0", 5000):
        assert route(router, tokens).prefill.node_id != "p0"
    assert route(router, tokens).prefill.node_id == "p0"


def test_replicas_agree_and_prefixes_spread():
    nodes = fleet(prefill=3, decode=2)
    a = Router(FakeDiscovery(nodes), make_policy("cache_aware"), FakeIndex(), 16)
    b = Router(FakeDiscovery(list(reversed(nodes))), make_policy("cache_aware"), FakeIndex(), 16)
    picks = set()
    for seed in range(12):
        tokens = prompt(seed, 200)
        da, db = route(a, tokens), route(b, tokens)
        assert (da.prefill.node_id, da.decode.node_id) == (db.prefill.node_id, db.decode.node_id)
        picks.add(da.prefill.node_id)
    assert len(picks) > 1  # cold prefixes do not all pile onto one node


def test_round_robin_and_least_loaded():
    rr = Router(FakeDiscovery(fleet()), make_policy("round_robin"), FakeIndex(), 16)
    assert [route(rr, prompt(9, 300)).prefill.node_id for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    loads = {"d0": NodeLoad(num_running=9), "d1": NodeLoad(num_running=2), "p1": NodeLoad(queued_prefill_tokens=10)}
    ll = Router(FakeDiscovery(fleet(loads=loads)), make_policy("least_loaded"), FakeIndex(), 16)
    d = route(ll, prompt(9, 300))
    assert d.decode.node_id == "d1" and d.prefill.node_id != "p1"
    with pytest.raises(ValueError, match="routing_policy"):
        make_policy("no_such_policy")


def test_refused_nodes_and_no_capacity():
    nodes = [node("p0", "prefill", model_id="other"), node("d0", "decode", block_size=32), node("d1", "decode")]
    disc = FakeDiscovery(nodes)
    assert [n.node_id for n in disc.routable("decode")] == ["d1"] and not disc.routable("prefill")
    assert "block size" in next(n for n in disc.nodes() if n.node_id == "d0").refused
    with pytest.raises(NoCapacity):
        route(Router(FakeDiscovery([node("p0", "prefill")]), make_policy("cache_aware"), FakeIndex(), 16), [1, 2])
    disc.trip("d1", "no answer to a health probe")
    assert not disc.routable("decode")


def test_index_down_still_routes():
    router = Router(FakeDiscovery(fleet()), make_policy("cache_aware"), FakeIndex(fail=True), 16)
    d = route(router, prompt(5, 300))
    assert d.decode is not None and router.index_error


def test_bad_request_names_the_field():
    err = BadRequest.from_value_error(ValueError("top_p: must be in (0, 1], got 5"))
    assert err.param == "top_p" and int(err.status) == 400
    assert BadRequest.from_value_error(ValueError("something odd happened: x")).param is None


# --------------------------------------------------------------------------------------- stop strings


def _choice(tok, stop, include=False) -> ChoiceOutput:
    return ChoiceOutput(0, tok, TokenTexts(tok), tok.encode("Q:"), OutputOptions(stop=stop,
                                                                                 include_stop_str_in_output=include))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(default_tokenizer, include):
    tok = default_tokenizer
    ids = tok.encode(" The answer is forty-two. Next question please.")
    choice = _choice(tok, ("two. Next",), include)
    streamed = ""
    for i, t in enumerate(ids):
        delta = choice.add(TokenChunk((t,), finish_reason="length" if i == len(ids) - 1 else ""))
        streamed += delta.text
        assert "two. Nex" not in streamed or include  # never a prefix of the stop string before the cut
        if choice.finished:
            break
    expected = " The answer is forty-two. Next" if include else " The answer is forty-"
    assert choice.text == streamed == expected
    assert (choice.finish_reason, choice.stop_reason) == ("stop", "two. Next")


def test_text_without_stop_is_complete(default_tokenizer):
    tok = default_tokenizer
    ids = tok.encode(" café ünïcode ✓ done")
    choice = _choice(tok, ("zzz",))
    text = "".join(choice.add(TokenChunk((t,), finish_reason="stop" if i == len(ids) - 1 else "")).text
                   for i, t in enumerate(ids))
    assert text == tok.decode(ids) and choice.finish_reason == "stop"
