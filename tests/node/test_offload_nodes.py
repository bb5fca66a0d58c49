"""The offload tier across real node processes of one host: blocks one node evicted are loaded by another,
after the writer was killed with SIGKILL, colocated and disaggregated, and the tokens (greedy and seeded) are
the ones an engine without a tier gives; the tier's blocks reach the block index in Redis, where routing sees
them. The nodes share a store folder under the test's tmp path."""

from __future__ import annotations

import os
import signal

import pytest

from kvrelay.common.hashing import kv_dtype_key, prompt_block_hashes
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.index import create_index, create_registry
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import (
    colocated_engine,
    disaggregated,
    generate,
    run_colocated,
    start_nodes,
    stop_nodes,
    tiny_args,
    wait_for,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=4, ignore_eos=True)
BLOCKS = 24  # 150-token prompts take 10 blocks each: the fourth has evicted the whole of the first
LOADED = 'kvrelay:kv_offload_blocks_total'


def _prompt(seed: int) -> list[int]:
    return [(7 * i + 31 * seed + 5) % 500 for i in range(150)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def nodes(model, tmp_path_factory, redis_server):
    store = str(tmp_path_factory.mktemp("offload"))
    args = tiny_args(model, "ucx", "--kv-offload-bytes", "64MiB", "--kv-offload-path", store, blocks=BLOCKS)
    args += ["--redis-url", redis_server.url]
    writer, prefill, decode = start_nodes([("decode", args), ("prefill", args), ("decode", args)])
    yield writer, prefill, decode, store
    writer.stop(2.0)
    assert stop_nodes([prefill, decode]) == [0, 0], decode.log_tail()


def _loaded(node) -> float:
    return node.metrics().value(LOADED, event="loaded") or 0.0


def _offloaded(node) -> float:
    return node.metrics().value(LOADED, event="offloaded") or 0.0


def _stored(store: str) -> int:
    return sum(1 for n in os.listdir(store) if n.endswith(".kvb"))


@pytest.mark.timeout(240)
def test_a_node_loads_what_a_killed_node_offloaded_with_the_same_tokens(model, nodes):
    writer, _, reader, store = nodes
    prompts = [_prompt(s) for s in range(4)]
    ref = colocated_engine(model, blocks=256)
    want = [run_colocated(ref, f"ref-{s}", prompts[0], p) for s, p in enumerate((GREEDY, SEEDED))]
    for i, p in enumerate(prompts):
        generate(writer, f"w-{i}", p, GREEDY)
    # The first prompt's 9 whole blocks (its 10th is partial) and the second's tail were evicted: all written down.
    offloaded = _offloaded(writer)
    assert offloaded >= 9
    wait_for(lambda: _stored(store) >= offloaded, 20, "the evicted blocks in the store")
    writer.proc.send_signal(signal.SIGKILL)
    writer.proc.wait(10)
    assert generate(reader, "r-greedy", prompts[0], GREEDY)[0] == want[0]
    assert _loaded(reader) == 9
    for i in (1, 2, 3):  # the reader's own cache fills: prompt 0's blocks leave it too
        generate(reader, f"r-{i}", prompts[i], GREEDY)
    assert generate(reader, "r-seeded", prompts[0], SEEDED)[0] == want[1]
    assert _loaded(reader) >= 18


@pytest.mark.timeout(240)
def test_disaggregated_output_is_colocated_output_with_the_tier(model, nodes):
    _, prefill, decode, store = nodes
    prompts = [_prompt(s) for s in range(10, 14)]
    ref = colocated_engine(model, blocks=256)
    want = run_colocated(ref, "ref", prompts[0], GREEDY)
    stored = _stored(store)
    for i, p in enumerate(prompts):
        assert disaggregated(prefill, decode, f"d-{i}", p, GREEDY).tokens == run_colocated(ref, f"ref-{i}", p, GREEDY)
    # The writers run behind the steps (on loaded cores, seconds behind). Each node's queue starts with the first
    # prompt's 9 whole blocks, the same files on both: 9 new files mean one node has written all of them.
    wait_for(lambda: _stored(store) >= stored + 9, 30, "the first prompt's blocks in the store")
    before = _loaded(prefill) + _loaded(decode)
    again = disaggregated(prefill, decode, "d-again", prompts[0], GREEDY)
    assert again.tokens == want
    assert _loaded(prefill) + _loaded(decode) >= before + 9  # the prompt came back from the tier, not recomputed


@pytest.mark.timeout(120)
def test_the_index_holds_the_tier_and_the_nodes_name_it_and_measure_its_cost(nodes, redis_server):
    """After the tests above: the store holds the first disaggregated prompt's blocks, which both live nodes
    loaded from it. Both name the one tier entry; the index answers for it like for a node; the janitor keeps it;
    each node publishes what a loaded token cost it against a computed one."""
    _, prefill, decode, _ = nodes
    model_id = decode.stub().GetNodeInfo(pb.NodeInfoRequest(), timeout=5).model_id
    registry = create_registry(redis_server.url)
    live = {reg.node_id: reg for reg, _ in registry.live_nodes(model_id)}
    ids = [n.info["node_id"] for n in (prefill, decode)]
    regs = [live[i] for i in ids]
    ((tier,),) = {reg.kv_tiers for reg in regs}
    assert tier.startswith("tier:memory:")
    index = create_index(redis_server.url, model_id)
    hashes = prompt_block_hashes(_prompt(10), model_id, regs[0].block_size, kv_dtype=kv_dtype_key("auto"))
    try:
        assert wait_for(lambda: index.lookup(hashes, [tier]) == {tier: 9}, 10, "the tier's entry in the index")
        assert tier not in registry.purge_dead_nodes(model_id)
        assert index.lookup(hashes, [tier]) == {tier: 9}

        def measured() -> bool:
            loads = {reg.node_id: load for reg, load in registry.live_nodes(model_id)}
            return all(0 < loads[i].kv_tier_token_cost <= 1 for i in ids)

        wait_for(measured, 15, "each node's measured cost of a loaded token in its heartbeat")
    finally:
        index.close()
        registry.close()
