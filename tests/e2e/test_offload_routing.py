"""Routing sees the offload tier, end to end: two colocated nodes as if on two hosts (each its own tier folder), a
real Redis, the gateway and the `openai` SDK. A conversation whose blocks one node evicted into its tier goes
back to that node, although nothing of it is resident anywhere and the gateway's tie-break prefers the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.common.hashing import kv_dtype_key, prompt_block_hashes
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.gateway.policies import rendezvous
from kvrelay.index import create_index, create_registry
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from tests.helpers.gateway import GatewayThread
from tests.helpers.models import make_tiny_with_tokenizer
from tests.helpers.nodes import BLOCK, generate, start_nodes, stop_nodes, tiny_args, wait_for

MODEL = "tiny-tier"
BLOCKS = 24  # 150-token prompts take 10 blocks each: the fourth has evicted the whole of the first


def _prompt(seed: int) -> list[int]:
    return [(7 * i + 31 * seed + 5) % 40000 + 100 for i in range(150)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, default_model_dir):
    from kvrelay.index.redis_server import start_redis

    model = str(make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny") / MODEL, Path(default_model_dir)))
    redis = start_redis()
    reg = ["--redis-url", redis.url, "--heartbeat-seconds", "0.5", "--registry-ttl", "3"]
    nodes = []
    try:
        nodes = start_nodes([("decode", tiny_args(model, "local", *reg, "--kv-offload-bytes", "16MiB",
                                                  "--kv-offload-path", str(tmp_path_factory.mktemp(f"host{i}")),
                                                  blocks=BLOCKS)) for i in range(2)])
        gw = GatewayThread(model=model, redis_url=redis.url, startup_timeout=30)
        wait_for(lambda: len(gw.gateway.discovery.routable("decode")) == 2, 30, "both nodes routable")
        yield gw, nodes, redis.url
        gw.close()
    finally:
        assert stop_nodes(nodes) == [0] * len(nodes), "".join(n.log_tail() for n in nodes)
        redis.stop()


@pytest.mark.timeout(180)
def test_a_conversation_goes_back_to_the_host_whose_tier_kept_it(fleet):
    gw, nodes, url = fleet
    model_id = nodes[0].stub().GetNodeInfo(pb.NodeInfoRequest(), timeout=5).model_id
    prompt = _prompt(0)
    hashes = prompt_block_hashes(prompt, model_id, BLOCK, kv_dtype=kv_dtype_key("auto"))
    ids = [n.info["node_id"] for n in nodes]
    # With nothing cached anywhere the gateway's tie-break picks the node of the smaller rendezvous hash of the
    # prompt's leading blocks: the conversation's earlier turns went to the other one.
    preferred = min(ids, key=lambda i: rendezvous(hashes[min(len(hashes), 8) - 1], i))
    keeper = nodes[1 - ids.index(preferred)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for s in range(4):  # the next three evict the first from the keeper's memory into its tier
        generate(keeper, f"turn-{s}", _prompt(s), greedy)
    registry, index = create_registry(url), create_index(url, model_id)
    try:
        tiers = {reg.node_id: reg.kv_tiers for reg, _ in registry.live_nodes(model_id)}
        (tier,) = tiers[keeper.info["node_id"]]
        wait_for(lambda: index.lookup(hashes, [tier]) == {tier: 9}, 10, "the keeper's tier in the index")
        wait_for(lambda: index.lookup(hashes, ids) == {}, 10, "no node holding any of it in memory")
    finally:
        index.close()
        registry.close()
    raw = gw.client(api_key="unused").completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert raw.headers["x-kvrelay-decode-node"] == keeper.info["node_id"] != preferred
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == 9 * BLOCK  # loaded, not computed
