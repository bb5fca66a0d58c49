"""Prefill and decode nodes as real processes on loopback, over auto (shared memory: both run on this
host), ucx (tcp) and nccl (gloo on CPU), the last pair with an fp8 KV cache (--kv-cache-dtype fp8: a quarter of
the float32 bytes move, and its blocks hash apart from the float32 cache's).

Disaggregated outputs (Reserve -> Prefill -> Generate with the hand-off) must equal the colocated engine's
(an EngineCore in this process, and the decode node prefilling locally), for prompts longer than the chunk
size, with a prefix hit on the prefill node, and with the decode node already holding a prefix, when only
the missing blocks may move.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from kvrelay.common import wire
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.system import usable_cores
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import (
    BLOCK,
    all_blocks_free,
    colocated_engine,
    disaggregated,
    generate,
    run_colocated,
    start_nodes,
    stop_nodes,
    tiny_args,
    wait_for,
)

# The tiny llama: 3 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes (float32), or 1 (fp8).
BYTES_PER_BLOCK = {"auto": 12288, "fp8": 3072}

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=12, ignore_eos=True),
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module", params=[("auto", "auto"), ("ucx", "auto"), ("nccl", "fp8")],
                ids=["auto", "ucx", "nccl-fp8kv"])
def setup(request) -> tuple[str, str]:
    """(connector, --kv-cache-dtype) of the node pair."""
    return request.param


@pytest.fixture(scope="module")
def engines(tiny_model):
    """The colocated reference engine of each KV dtype, made on first use."""
    made: dict[str, object] = {}
    return lambda kv: made.get(kv) or made.setdefault(kv, colocated_engine(tiny_model, kv_cache_dtype=kv))


@pytest.fixture(scope="module")
def reference(engines, setup):
    return engines(setup[1])


@pytest.fixture(scope="module")
def pair(setup, tiny_model):
    connector, kv = setup
    cores = usable_cores()  # each pinned to a core of its own where there are two
    args = [(role, tiny_args(tiny_model, connector, "--cpu-cores", str(core), "--kv-cache-dtype", kv))
            for role, core in (("prefill", cores[-1]), ("decode", cores[0]))]
    prefill, decode = start_nodes(args)
    yield prefill, decode
    assert stop_nodes([prefill, decode]) == [0, 0], prefill.log_tail() + decode.log_tail()


def _prompt(seed: int, n: int) -> list[int]:
    return [(7 * i + 13 * seed + 3) % 500 for i in range(n)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(PARAMS))
def test_disaggregated_equals_colocated(pair, reference, setup, kind):
    prefill, decode = pair
    block_bytes = BYTES_PER_BLOCK[setup[1]]
    params = PARAMS[kind]
    prompt = _prompt(list(PARAMS).index(kind), 150)  # longer than the 64-token chunk: 3 prefill chunks
    expected = run_colocated(reference, f"c{next(_ids)}", prompt, params)

    first = disaggregated(prefill, decode, f"r{next(_ids)}", prompt, params)
    assert first.tokens == expected
    assert first.reservation.num_cached_tokens == 0 and first.prefill.num_cached_tokens == 0
    assert first.prefill.bytes_transferred == 10 * block_bytes  # ceil(150 / 16) blocks, all of them
    assert first.chunks[-1].finish_reason == "length" and first.chunks[-1].num_output_tokens == 12

    # Again: a prefix hit on the prefill node (9 full blocks), and the decode node holds them too now.
    again = disaggregated(prefill, decode, f"r{next(_ids)}", prompt, params)
    assert again.tokens == expected
    assert again.prefill.num_cached_tokens == 144
    assert again.reservation.num_cached_tokens == 144
    assert again.prefill.bytes_transferred == 1 * block_bytes

    # A longer prompt sharing the prefix: only the blocks the decode node lacks move.
    longer = prompt + [11, 12, 13] * 20
    expected_longer = run_colocated(reference, f"c{next(_ids)}", longer, params)
    third = disaggregated(prefill, decode, f"r{next(_ids)}", longer, params)
    assert third.tokens == expected_longer
    held = third.reservation.num_cached_tokens // BLOCK
    assert held == 9
    missing = -(-len(longer) // BLOCK) - held
    assert len(third.reservation.dst_block_ids) == missing
    assert third.prefill.bytes_transferred == missing * block_bytes

    # The decode node prefilling locally gives the same tokens.
    local, _ = generate(decode, f"g{next(_ids)}", longer, params)
    assert local == expected_longer
    if prefill.info["kv_address"].startswith("auto://"):  # one host: the auto connector chose shared memory
        assert "go over shm" in prefill.log_path.read_text()

    for node in pair:
        wait_for(lambda n=node: all_blocks_free(n), 5, f"{node.role} node to free every block")


@pytest.mark.timeout(60)
def test_logprobs_and_first_token_stop(pair, reference):
    prefill, decode = pair
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    prompt = _prompt(5, 40)
    result = disaggregated(prefill, decode, f"r{next(_ids)}", prompt, params)
    assert result.tokens == run_colocated(reference, f"c{next(_ids)}", prompt, params)
    lp = result.prefill.first_logprobs
    assert lp.token_id == result.tokens[0] and len(lp.top) == 3 and lp.rank >= 1
    assert result.chunks[0].logprobs[0].token_id == result.tokens[0]  # the hand-off's logprobs come back
    assert all(len(c.logprobs) == 1 for c in result.chunks)

    # max_tokens=1: the first token already ends it, and the prefill node says so.
    one = SamplingParams(temperature=0.0, max_tokens=1)
    short = disaggregated(prefill, decode, f"r{next(_ids)}", prompt, one)
    assert short.prefill.finish_reason == "length"
    assert short.tokens == [result.tokens[0]] and short.chunks[-1].finish_reason == "length"


def test_nodes_run_on_the_cores_they_were_given(pair):
    prefill, decode = pair
    for node, core in ((prefill, usable_cores()[-1]), (decode, usable_cores()[0])):
        threads = Path(f"/proc/{node.proc.pid}/task").iterdir()
        allowed = {line.split(":")[1].strip() for t in threads for line in (t / "status").read_text().splitlines()
                   if line.startswith("Cpus_allowed_list:")}
        assert allowed == {str(core)}, node.log_tail()


@pytest.mark.timeout(30)
def test_metrics(pair, setup):
    prefill, decode = pair
    p, d = prefill.metrics(), decode.metrics()
    kv_dtype = "float32" if setup[1] == "auto" else setup[1]
    assert p.value("vllm:cache_config_info", cache_dtype=kv_dtype, block_size="16") == 1
    connector = prefill.info["kv_address"].split("://")[0]
    sent = p.value("kvrelay:kv_transfer_bytes_total", connector=connector, direction="send")
    assert sent > 0
    assert p.value("kvrelay:kv_transfer_seconds_count", connector=connector, direction="send") >= 6
    assert d.value("kvrelay:kv_transfer_bytes_total", connector=connector, direction="recv") == sent
    name = prefill.stub().GetNodeInfo(pb.NodeInfoRequest(), timeout=5).model_id
    assert p.value("vllm:time_to_first_token_seconds_count", model_name=name) >= 6
    assert p.value("vllm:prefix_cache_hits_total", model_name=name) >= 144
    assert d.value("vllm:prefix_cache_queries_total", model_name=name) > \
        d.value("vllm:prefix_cache_hits_total", model_name=name) > 0
    assert d.value("vllm:generation_tokens_total", model_name=name) > 0
    assert d.value("vllm:inter_token_latency_seconds_count", model_name=name) > 0
    assert d.value("vllm:request_success_total", finished_reason="length", model_name=name) >= 6
    assert d.value("vllm:num_requests_running", model_name=name) == 0
    assert d.value("vllm:kv_cache_usage_perc", model_name=name) == 0
    for exported in ("kvrelay:queued_prefill_tokens", "vllm:num_preemptions_total",
                     "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total"):
        assert d.value(exported, model_name=name) is not None, exported


@pytest.mark.timeout(240)
def test_default_model_disaggregated(default_model_dir):
    """The default model (SmolLM2-135M) served from its GGUF blocks (--quantization gguf) over ucx:
    disaggregated greedy output = local prefill output."""
    args = ["--model", "default", "--quantization", "gguf", "--num-threads", "1", "--kv-cache-memory",
            str(64 * 2**20), "--connector", "ucx", "--shutdown-timeout", "10"]
    prefill, decode = start_nodes([("prefill", args), ("decode", args)], timeout=200)
    try:
        prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 4210, 30, 378, 3458, 282, 4649, 314] * 3
        params = SamplingParams(temperature=0.0, max_tokens=6)
        local, _ = generate(prefill, "local", prompt, params)  # Generate without hand-off works on any role
        result = disaggregated(prefill, decode, "disagg", prompt, params)
        assert result.tokens == local
        # 45 tokens: 3 blocks of 30 layers x K, V, in whatever dtype `auto` chose on this machine.
        layout = wire.layout_from_proto(decode.stub().GetNodeInfo(pb.NodeInfoRequest(), timeout=10).layout)
        assert (layout.num_layers, layout.block_size) == (30, 16)
        assert result.prefill.bytes_transferred == layout.transfer_nbytes(3)
    finally:
        assert stop_nodes([prefill, decode]) == [0, 0]


@pytest.mark.timeout(60)
def test_async_engine_in_process(tiny_model, engines):
    """The engine thread behind the asyncio API: same tokens, n > 1, early exit aborts, draining refuses."""
    import asyncio

    from kvrelay.engine.async_engine import AsyncEngine
    from kvrelay.engine.engine_hooks import EngineDraining

    prompt = _prompt(9, 100)
    params = PARAMS["seeded"]
    expected = run_colocated(engines("auto"), f"c{next(_ids)}", prompt, params)

    async def scenario() -> None:
        engine = AsyncEngine(colocated_engine(tiny_model))
        engine.start()
        got = [t async for out in engine.generate("a", prompt, params) for t in out.new_token_ids]
        assert got == expected
        by_child: dict[str, list[int]] = {}
        async for out in engine.generate("n", prompt, dataclasses.replace(params, n=2)):
            by_child.setdefault(out.req_id, []).extend(out.new_token_ids)
        assert sorted(by_child) == ["n#0", "n#1"] and by_child["n#0"] == expected
        with pytest.raises(ValueError, match="prompt"):
            [o async for o in engine.generate("bad", [], params)]
        stream = engine.generate("early", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()  # leaving early aborts: nothing keeps running
        await asyncio.sleep(0.3)
        load = engine.load()
        assert load.num_running == 0 and load.free_kv_blocks == load.total_kv_blocks
        engine.stop_accepting()
        with pytest.raises(EngineDraining):
            [o async for o in engine.generate("late", prompt, params)]
        await engine.shutdown(timeout=5)
        assert not engine.running

    asyncio.run(scenario())
