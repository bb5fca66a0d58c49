"""Node processes and a small engine-service client for the node tests.

Nodes run as real processes on loopback (tests.helpers.procs.NodeProcess), one torch thread each: the tests
share two cores. The client drives the disaggregated flow the way the gateway does: Reserve -> Prefill -> Generate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from kvrelay.common.process import stop_all
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.wire import sampling_to_proto
from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.engine.core import EngineCore
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from tests.helpers.procs import NodeProcess

BLOCK = 16
CHUNK = 64  # --max-num-batched-tokens: prompts longer than this are prefilled in chunks
TINY_BLOCKS = 64
NODE_ENV = {"OMP_NUM_THREADS": "1", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def tiny_args(model: str, connector: str = "ucx", *extra: str, blocks: int = TINY_BLOCKS) -> list[str]:
    # 12288 bytes per block: 3 layers x K and V x 16 tokens x 2 heads x 16 dims x 4 bytes.
    return ["--model", model, "--dtype", "float32", "--num-threads", "1", "--connector", connector,
            "--max-num-batched-tokens", str(CHUNK), "--block-size", str(BLOCK),
            "--kv-cache-memory", str(blocks * 12288), "--shutdown-timeout", "10", *extra]


def start_nodes(specs: list[tuple[str, list[str]]], timeout: float = 150.0) -> list[NodeProcess]:
    return NodeProcess.start_many(specs, env=NODE_ENV, timeout=timeout)


def stop_nodes(nodes: Iterable[NodeProcess], grace: float = 20.0) -> list[int]:
    """SIGTERM all at once (their shutdowns overlap), then reap each; the exit codes."""
    return stop_all(nodes, grace)


def colocated_engine(model: str, blocks: int = TINY_BLOCKS, kv_cache_dtype: str = "auto") -> EngineCore:
    """The reference: one engine in this process, configured like the nodes."""
    return EngineCore(EngineConfig(
        model=ModelConfig(model=model, dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=blocks, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK),
    ))


def run_colocated(engine: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request(rid, prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


# -- client ---------------------------------------------------------------------------------------------


def reserve(decode: NodeProcess, rid: str, prompt: list[int], params: SamplingParams,
            lease_ms: int = 0) -> pb.ReserveResponse:
    return decode.stub().Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                   params=sampling_to_proto(params), lease_ms=lease_ms), timeout=30)


def prefill_request(rid: str, prompt: list[int], params: SamplingParams, res: pb.ReserveResponse,
                    with_layout: bool = True) -> pb.PrefillRequest:
    req = pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(params),
                            decode_kv_address=res.kv_address, decode_cached_tokens=res.num_cached_tokens,
                            dst_block_ids=res.dst_block_ids, transfer_id=res.transfer_id)
    if with_layout:
        req.decode_layout.CopyFrom(res.layout)
    return req


def generate(node: NodeProcess, rid: str, prompt: list[int], params: SamplingParams,
             handoff: pb.PrefillResponse | None = None) -> tuple[list[int], list[pb.TokenChunk]]:
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(params))
    if handoff is not None:
        req.handoff.CopyFrom(pb.Handoff(first_token_id=handoff.first_token_id))
        if handoff.HasField("first_logprobs"):
            req.handoff.first_logprobs.CopyFrom(handoff.first_logprobs)
    chunks = list(node.stub().Generate(req, timeout=60))
    return [t for c in chunks for t in c.token_ids], chunks


@dataclass
class DisaggResult:
    tokens: list[int]
    reservation: pb.ReserveResponse
    prefill: pb.PrefillResponse
    chunks: list[pb.TokenChunk]


def disaggregated(prefill: NodeProcess, decode: NodeProcess, rid: str, prompt: list[int],
                  params: SamplingParams) -> DisaggResult:
    res = reserve(decode, rid, prompt, params)
    pre = prefill.stub().Prefill(prefill_request(rid, prompt, params, res), timeout=60)
    tokens, chunks = generate(decode, rid, prompt, params, handoff=pre)
    return DisaggResult(tokens, res, pre, chunks)


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    """Call and return the RpcError it must raise."""
    try:
        fn(*args, **kwargs)
    except grpc.RpcError as e:
        return e
    raise AssertionError(f"{fn} succeeded; an error was expected")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def all_blocks_free(node: NodeProcess) -> bool:
    load = node.load()
    return load.free_kv_blocks == load.total_kv_blocks and load.num_running == 0 and load.num_waiting == 0


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """Run fn in a thread; the dict gets 'result' or 'error'."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box
