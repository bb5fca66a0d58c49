"""`kvrelay bench routing`: what a routing decision and the gateway itself cost.

1. decision: the gateway's routing decision for a 4,096-token prompt (hash its blocks, one index lookup, score
   every candidate) with 100 nodes registered in a real Redis registry and index (the index workload of
   `bench index-lookup`); p50/p99 of the whole and of each part, looking up in the gateway's in-process mirror
   and with a Redis round trip (target with the mirror: p99 <= 0.5 ms), with the CPU time per decision on each
   side; the portable Python hashing loop for comparison; and the mirror's lag behind a flood of block events
   while decisions go on. No node processes.
2. overhead: a fleet (`kvrelay up`, --prefill and --decode nodes); TTFT through the gateway minus TTFT calling
   the decode node directly over gRPC, for the same short prompt that the decode node prefills itself, requests
   alternating; p50 (target: <= 2 ms), and the gateway's CPU time per request.

What cache-aware routing buys over round robin (prefix-hit ratio, TTFT) is `kvrelay bench fleet --scenario
routing`. Read latencies against `loop_1m_ms`, how long a million-iteration Python loop took before and after:
on a shared machine it says how busy the cores were.

    kvrelay bench routing
    kvrelay bench routing --skip-overhead
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import threading
import time

from kvrelay.bench.client import Client
from kvrelay.bench.fleet import Server, process_cpu_s
from kvrelay.bench.index_lookup import BLOCK_SIZE, index_workload, time_calls
from kvrelay.bench.report import emit, machine
from kvrelay.bench.stats import percentiles, timings
from kvrelay.common.hashing import _hash_blocks_py, prompt_block_hashes, root_hash
from kvrelay.common.records import BlockEvent, BlockEventKind, NodeLoad

HELP = "routing decision time (mirror and Redis lookups), gateway TTFT overhead"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("decision")
    d.add_argument("--decision-nodes", type=int, default=100, help="nodes registered")
    d.add_argument("--decision-tokens", type=int, default=4096, help="prompt length")
    d.add_argument("--decision-iters", type=int, default=2000, help="timed decisions")
    d.add_argument("--lag-seconds", type=float, default=3.0, help="seconds of the event flood behind the mirror")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--skip-decision", action="store_true")
    o = p.add_argument_group("overhead")
    o.add_argument("--model", default="default", help="passed to `kvrelay up --model`")
    o.add_argument("--prefill", type=int, default=3, help="prefill nodes")
    o.add_argument("--decode", type=int, default=2, help="decode nodes")
    o.add_argument("--overhead-iters", type=int, default=200, help="requests each way")
    o.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--output", default="bench/results/routing.json", help="JSON result file (the fleet's log beside)")


def loop_1m_ms() -> float:
    t0, total = time.perf_counter(), 0
    for i in range(1_000_000):
        total += i
    return round((time.perf_counter() - t0) * 1000, 1)


# -- decision ---------------------------------------------------------------------------------------------


def bench_decision(num_nodes: int, num_tokens: int, iters: int, seed: int, lag_seconds: float) -> dict:
    from kvrelay.index import create_index, create_registry
    from kvrelay.index.base import NodeRegistration
    from kvrelay.index.redis_server import start_redis

    model_id, rng = "bench-routing", random.Random(seed)
    work = index_workload(model_id, num_nodes, num_tokens, 500, seed)
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as tmp, \
            start_redis(os.path.join(tmp, "redis.sock")) as server:
        index = create_index(server.url, model_id, backend="redis")
        work.store(index)
        mirror = create_index(server.url, model_id, backend="mirror")
        if not (mirror.wait_ready(10) and mirror.sync(10)):
            raise RuntimeError(f"the index mirror did not load: {mirror.stats()}")
        registry = create_registry(server.url)
        for i, node_id in enumerate(work.held):  # registrations only: no process behind the addresses
            reg = NodeRegistration(node_id=node_id, role="prefill" if i % 2 else "decode", kv_address="",
                                   grpc_address=f"127.0.0.1:{20000 + i}", connector="auto", model_id=model_id,
                                   block_size=BLOCK_SIZE, dtype="float32", capacity_tokens=160_000)
            load = NodeLoad(num_running=rng.randrange(8), queued_prefill_tokens=rng.randrange(4096),
                            free_kv_blocks=10_000, total_kv_blocks=10_000)
            registry.register(reg, 600.0, load)
        try:
            result = asyncio.run(_decisions(work, index, mirror, registry, iters, lag_seconds, rng))
        finally:
            for closable in (mirror, index, registry):
                closable.close()
    result.update(num_nodes=num_nodes, prompt_tokens=num_tokens, iters=iters, target_p99_ms=0.5,
                  meets_target=result["mirror"]["total_ms"]["p99"] <= 0.5)
    return result


async def _decisions(work, index, mirror, registry, iters: int, lag_seconds: float, rng: random.Random) -> dict:
    from kvrelay.gateway.discovery import Discovery, DiscoveryConfig
    from kvrelay.gateway.node_client import NodeClients
    from kvrelay.gateway.policies import make_policy
    from kvrelay.gateway.router import Router

    discovery = Discovery(DiscoveryConfig(model_id=work.model_id, block_size=BLOCK_SIZE), NodeClients(), registry)
    await discovery.refresh_registry()
    routers = {name: Router(discovery, make_policy("cache_aware"), idx, local_prefill_threshold=64)
               for name, idx in (("mirror", mirror), ("redis", index))}
    result: dict = {}
    try:
        for name, router in routers.items():
            total = await time_calls(router.route, work.queries, iters, index.client)
            result[name] = {"total_ms": total, "cpu_per_decision_ms": total.pop("cpu_per_call"),
                            **_parts(router, work.queries, iters)}
        if [mirror.lookup(h) for h in work.query_hashes()] != [index.lookup(h) for h in work.query_hashes()]:
            raise RuntimeError("the mirror's lookups differ from Redis's")
        result["mirror_under_load"] = await _mirror_lag(index, mirror, routers["mirror"], work.queries, lag_seconds,
                                                        rng)
    finally:
        for router in routers.values():
            router.close()
        await discovery.stop()
    root = root_hash(work.model_id, BLOCK_SIZE)
    result["hash_python_ms"] = _timed(lambda q: _hash_blocks_py(q, BLOCK_SIZE, root), work.queries, iters)
    return result


def _timed(fn, args: list, iters: int) -> dict:
    """Percentiles (ms) of fn(arg), cycling through args, one call at a time."""
    return {**percentiles(timings(fn, 0.0, iters, warmup=0, args=args), 1000, digits=4), "n": iters}


def _parts(router, queries: list[list[int]], iters: int) -> dict:
    """Each part of a decision on its own: hashing, the index lookup, scoring."""
    prefill, decode = router.discovery.routable("prefill"), router.discovery.routable("decode")
    hashes = [prompt_block_hashes(q, router.model_id, router.block_size) for q in queries]
    hits = [router.index.lookup(h) for h in hashes]
    return {"hash_ms": _timed(lambda q: prompt_block_hashes(q, router.model_id, router.block_size), queries, iters),
            "lookup_ms": _timed(router.index.lookup, hashes, iters),
            "score_ms": _timed(lambda i: router.decide(queries[i], hashes[i], hits[i], prefill, decode),
                               list(range(len(queries))), iters)}


async def _mirror_lag(index, mirror, router, queries, seconds: float, rng: random.Random) -> dict:
    """A publisher thread applies batches of 64 events (stores, then evictions of the same blocks) from 100 nodes
    as fast as Redis takes them for `seconds`, while decisions run on the mirror. Lag: from an event's write in
    Redis (its stream entry id) to its application in the mirror."""
    stop, sent = threading.Event(), [0]
    batches = [[rng.randbytes(16) for _ in range(64)] for _ in range(32)]

    def publish() -> None:
        i = 0
        while not stop.is_set():
            kind = BlockEventKind.STORED if (i // 100) % 2 == 0 else BlockEventKind.EVICTED
            index.apply(f"load-{i % 100:03d}", [BlockEvent(kind, h) for h in batches[i % len(batches)]])
            sent[0], i = sent[0] + 64, i + 1

    mirror.lag_ms.clear()
    before, decisions = mirror.stats()["events"], []
    thread = threading.Thread(target=publish, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    while time.perf_counter() - t0 < seconds:
        t1 = time.perf_counter()
        await router.route(queries[len(decisions) % len(queries)])
        decisions.append(time.perf_counter() - t1)
        await asyncio.sleep(0.001)  # a gateway also serves requests: leave the follower some GIL
    stop.set()
    thread.join()
    elapsed = time.perf_counter() - t0
    synced = await asyncio.to_thread(mirror.sync, 10)
    return {"events_per_s": round(sent[0] / elapsed), "entries_applied": mirror.stats()["events"] - before,
            "lag_ms": percentiles(list(mirror.lag_ms), digits=4) if mirror.lag_ms else None, "caught_up": synced,
            "decision_ms": percentiles(decisions, 1000, digits=4), "gaps": mirror.stats()["gaps"]}


# -- overhead -------------------------------------------------------------------------------------------


def bench_overhead(args: argparse.Namespace) -> dict:
    """The same request alternately through the gateway and straight to the decode node the gateway picks."""
    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.model_files.resolve import resolve_model

    ids = Tokenizer(resolve_model(args.model).path).encode("Hello, how are you today?")
    flags = ["--model", args.model, "--prefill", str(args.prefill), "--decode", str(args.decode), "--dtype", "float32"]
    with Server.up(flags, log_dir=os.path.dirname(os.path.abspath(args.output))) as fleet:
        return asyncio.run(_overhead(fleet, ids, args.overhead_iters)) | {"kvrelay_up_flags": flags}


async def _overhead(fleet: Server, ids: list[int], iters: int) -> dict:
    from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
    from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

    body = {"prompt": ids, "max_tokens": 1, "stream": True, "temperature": 0, "ignore_eos": True}
    params = pb.SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=1, ignore_eos=True, repetition_penalty=1.0)
    direct, through = [], []
    async with Client(fleet.base_url, timeout_s=60) as client:
        node_id = (await client.post("completions", body)).headers.get("x-kvrelay-decode-node")
        address = next(n["address"] for n in fleet.health()["nodes"] if n["node_id"] == node_id)
        async with fleet.node_channel(address, aio=True) as channel:
            stub = pb_grpc.EngineStub(channel)

            async def via_node(i: int) -> float:
                request = pb.GenerateRequest(request_id=f"bench-direct-{i}-{time.time_ns()}", prompt_token_ids=ids,
                                             params=params)
                t0 = time.perf_counter()
                async for _ in stub.Generate(request, timeout=60):
                    return time.perf_counter() - t0
                raise RuntimeError("no token from the node")

            for i in range(min(20, iters)):  # warm-up
                await client.post("completions", body)
                await via_node(i)
            gateway = fleet.pids()["gateway"]
            cpu0 = process_cpu_s(gateway)
            for i in range(iters):
                reply = await client.post("completions", body)
                if reply.ok and reply.headers.get("x-kvrelay-decode-node") == node_id:
                    through.append(reply.ttft_s)
                direct.append(await via_node(i))
            cpu = process_cpu_s(gateway) - cpu0
    d, g = percentiles(direct, 1000, digits=4), percentiles(through, 1000, digits=4)
    overhead = round(g["p50"] - d["p50"], 3)
    return {"direct_ttft_ms": {**d, "n": len(direct)}, "gateway_ttft_ms": {**g, "n": len(through)},
            "overhead_p50_ms": overhead, "target_ms": 2.0, "meets_target": overhead <= 2.0, "prompt_tokens": len(ids),
            "gateway_cpu_per_request_ms": round(cpu / iters * 1000, 3)}


def run(args: argparse.Namespace) -> int:
    result: dict = {"benchmark": "routing", "machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "loop_1m_ms_before": loop_1m_ms()}
    if not args.skip_decision:
        result["decision"] = bench_decision(args.decision_nodes, args.decision_tokens, args.decision_iters, args.seed,
                                            args.lag_seconds)
    if not args.skip_overhead:
        result["overhead"] = bench_overhead(args)
    result["loop_1m_ms_after"] = loop_1m_ms()
    emit(result, args.output)
    return 0
