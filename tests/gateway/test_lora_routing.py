"""Several models and LoRA adapters in the gateway, without a network: names resolving to models and adapters,
/v1/models' cards against the openai SDK's types, adapter-aware routing (residency, a burst spreading, prefixes
per adapter), and the block index keeping adapters and models apart."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from openai.pagination import SyncPage
from openai.types import Model

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.records import BlockEvent, BlockEventKind, NodeLoad
from kvrelay.gateway.adapters import RESIDENCY_COST, AdapterRecord, Adapters, Residency, residency
from kvrelay.gateway.errors import ModelNotFound, NoCapacity
from kvrelay.gateway.models import ModelEndpoint, ServedModels, assign_names
from kvrelay.gateway.node_client import NodeClients
from kvrelay.gateway.policies import make_policy
from kvrelay.gateway.router import Router
from kvrelay.index import create_index, create_registry
from kvrelay.index.base import NodeRegistration
from tests.gateway.test_unit import BS, MODEL, FakeDiscovery, FakeIndex, node, prompt


def lora_load(resident=(), adapters=None, capacity=2, running=0) -> NodeLoad:
    return NodeLoad(num_running=running, lora_adapters=tuple(adapters if adapters is not None else resident),
                    lora_resident=tuple(resident), lora_capacity=capacity)


def lora_router(nodes, index=None, records=()):
    discovery = FakeDiscovery(nodes)
    adapters = Adapters(discovery.nodes, NodeClients())
    for record in records:
        adapters.records[record.name] = record
    return Router(discovery, make_policy("cache_aware"), index or FakeIndex(), 16, lora_costs=adapters.extra_cost)


def pick(router: Router, tokens, lora: str):
    return asyncio.run(router.route(tokens, lora_name=lora)).decode.node_id


# -- routing ------------------------------------------------------------------------------------------------


def test_residency_and_its_cost():
    assert residency(node("d0", "decode", lora_load(["a"])), "a") is Residency.LOADED
    assert residency(node("d0", "decode", lora_load(["b"])), "a") is Residency.FREE
    assert residency(node("d0", "decode", lora_load(["b", "c"])), "a") is Residency.EVICT
    assert RESIDENCY_COST[Residency.LOADED] < RESIDENCY_COST[Residency.FREE] < RESIDENCY_COST[Residency.EVICT]


def test_adapter_requests_go_where_it_is_loaded_and_only_to_nodes_that_can_run_it():
    nodes = [node("d0", "decode", lora_load(["b", "c"])), node("d1", "decode", lora_load(["a"])),
             node("d2", "decode", NodeLoad()), node("d3", "decode", lora_load([]))]
    router = lora_router(nodes, records=[AdapterRecord("a", MODEL, "/x/a")])
    assert pick(router, prompt(1, 40), "a") == "d1"  # loaded beats free (d3) and evict (d0)
    decision = asyncio.run(router.route(prompt(1, 40), lora_name="a"))
    assert [n.node_id for n in decision.decode_fallbacks] == ["d3", "d0"]  # d2 runs no LoRA at all
    # An adapter known only from the nodes' reports (no path): just the nodes that hold it.
    reported = lora_router([node("d0", "decode", lora_load(["z"], capacity=4)), node("d1", "decode", lora_load([]))])
    decision = asyncio.run(reported.route(prompt(2, 40), lora_name="z"))
    assert decision.decode.node_id == "d0" and decision.decode_fallbacks == ()
    with pytest.raises(NoCapacity, match="LoRA adapter 'nope'"):
        asyncio.run(reported.route(prompt(2, 40), lora_name="nope"))


def test_a_burst_for_one_adapter_spreads_to_a_second_node():
    record = AdapterRecord("a", MODEL, "/x/a")
    quiet = [node("d0", "decode", lora_load(["a"], running=1)), node("d1", "decode", lora_load([], running=0))]
    assert pick(lora_router(quiet, records=[record]), prompt(3, 40), "a") == "d0"
    busy = [node("d0", "decode", lora_load(["a"], running=4)), node("d1", "decode", lora_load([], running=0))]
    assert pick(lora_router(busy, records=[record]), prompt(3, 40), "a") == "d1"


def test_cached_prefixes_count_per_adapter():
    tokens = prompt(4, 320)
    under_a = prompt_block_hashes(tokens, MODEL, BS, lora_name="a")
    nodes = [node(f"d{i}", "decode", lora_load(["a", "b"], capacity=4)) for i in range(3)]
    records = [AdapterRecord(n, MODEL, f"/x/{n}") for n in ("a", "b")]
    router = lora_router(nodes, FakeIndex({"d2": under_a}), records)
    assert asyncio.run(router.route(tokens, lora_name="a")).decode_cached_tokens == 319
    assert pick(router, tokens, "a") == "d2"
    assert asyncio.run(router.route(tokens, lora_name="b")).decode_cached_tokens == 0
    assert asyncio.run(router.route(tokens)).decode_cached_tokens == 0


def test_the_index_never_matches_another_adapter_the_base_model_or_another_model():
    registry, store = create_registry("memory://lora-index"), "memory://lora-index"
    registry.register(NodeRegistration(node_id="n0", role="decode", grpc_address="n0:1", kv_address="", connector="",
                                       model_id=MODEL, block_size=BS, dtype="float32", capacity_tokens=1024), ttl_s=30)
    index = create_index(store, MODEL)
    tokens = prompt(5, 96)
    under_a = prompt_block_hashes(tokens, MODEL, BS, lora_name="a")
    index.apply("n0", [BlockEvent(BlockEventKind.STORED, h) for h in under_a])
    assert index.lookup(under_a) == {"n0": 6}
    assert index.lookup(prompt_block_hashes(tokens, MODEL, BS, lora_name="b")) == {}
    assert index.lookup(prompt_block_hashes(tokens, MODEL, BS)) == {}
    assert create_index(store, "other-model").lookup(under_a) == {}


def test_an_unloaded_adapter_stays_gone_while_the_nodes_loads_predate_the_unload():
    class NodeRpcs:  # each node's unload answer, as a node gives it once the adapter is gone
        def __init__(self) -> None:
            self.unloaded: list[tuple[str, str]] = []

        def get(self, address: str):
            async def unload_lora_adapter(name: str) -> list[str]:
                self.unloaded.append((address, name))
                return []

            return SimpleNamespace(unload_lora_adapter=unload_lora_adapter)

    def holding(*names: str) -> NodeLoad:
        return NodeLoad(lora_adapters=names, lora_resident=names, lora_paths=tuple(f"/x/{n}" for n in names),
                        lora_capacity=2)

    stale = [node("d0", "decode", holding("a", "b")), node("d1", "decode", holding())]
    listed, rpcs = [stale], NodeRpcs()
    adapters = Adapters(lambda: listed[0], rpcs)
    assert adapters.get("a") == AdapterRecord("a", MODEL, "/x/a")
    asyncio.run(adapters.unload("a"))
    assert rpcs.unloaded == [("d0:1", "a")]
    # The loads the gateway holds still list it (taken before the unload), and so do fresh lists of them.
    for nodes in (stale, list(stale)):
        listed[0] = nodes
        assert adapters.get("a") is None and [r.name for r in adapters.served()] == ["b"]
        assert not adapters.holds(stale[0], "a") and adapters.extra_cost(stale[1], "a") is None
    # d0's next load lists it no more: the node's reports count again (it loads "a" at a restart, say).
    listed[0] = [node("d0", "decode", holding("b")), stale[1]]
    assert adapters.get("a") is None
    listed[0] = [node("d0", "decode", holding("a", "b")), stale[1]]
    assert adapters.get("a") == AdapterRecord("a", MODEL, "/x/a") and adapters.holds(listed[0][0], "a")


# -- names and models ---------------------------------------------------------------------------------------


def test_served_names_go_to_their_models():
    assert assign_names(["m1", "m2"], ["/p/m1", "/p/m2"], []) == [("m1",), ("m2",)]
    assert assign_names(["m1", "m2"], ["/p/m1", "/p/m2"], ["chat", "small=/p/m2", "tiny=m2"]) == [
        ("chat",), ("small", "tiny")]
    with pytest.raises(ValueError, match="not served here"):
        assign_names(["m1"], ["/p/m1"], ["x=m9"])
    with pytest.raises(ValueError, match="would name both"):
        assign_names(["m1", "m2"], ["/p/m1", "/p/m2"], ["x", "x=m2"])


def _endpoint(model_id: str, names: tuple[str, ...]) -> ModelEndpoint:
    core = SimpleNamespace(max_model_len=2048)
    return ModelEndpoint(model_id, f"/p/{model_id}", names, None, None, None, None, core, None, None, None, None,
                         None)


def test_models_resolve_and_list_with_vllm_fields_as_the_sdk_reads_them():
    discovery = FakeDiscovery([node("d0", "decode", lora_load(["from-node"], capacity=4))])
    adapters = Adapters(discovery.nodes, NodeClients())
    adapters.records["sql"] = AdapterRecord("sql", MODEL, "/adapters/sql")
    models = ServedModels([_endpoint(MODEL, ("chat", "assistant")), _endpoint("m2", ("m2",))], adapters)
    assert models.resolve(None).name == "chat" and models.resolve("").endpoint.model_id == MODEL
    assert models.resolve("m2").endpoint.model_id == "m2" and models.resolve("m2").lora_name == ""
    sql = models.resolve("sql")
    assert (sql.endpoint.model_id, sql.lora_name, sql.name) == (MODEL, "sql", "sql")
    assert models.resolve("from-node").lora_name == "from-node"
    with pytest.raises(ModelNotFound) as err:
        models.resolve("gpt-4")
    assert int(err.value.status) == 404 and err.value.code == "model_not_found"
    page = SyncPage[Model].model_validate(
        {"object": "list", "data": [{"created": 1, "object": "model", "owned_by": "kvrelay", **c}
                                    for c in models.cards()]})
    by_id = {m.id: m for m in page.data}
    assert set(by_id) == {"chat", "assistant", "m2", "sql", "from-node"}
    assert by_id["sql"].parent == "chat" and by_id["sql"].root == "/adapters/sql"
    assert by_id["m2"].root == "m2" and by_id["m2"].parent is None
