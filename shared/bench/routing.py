"""`kvrelay bench routing`: what KV-cache-aware routing buys, and what the gateway itself costs.

1. decision: the gateway's routing decision for a 4,096-token prompt (hash its blocks, one index lookup,
   score every candidate) with 100 nodes in a real Redis index; p50/p99 of the whole and of each part,
   looking up in the gateway's in-process mirror and with a Redis round trip (target with the mirror: p99
   <= 0.5 ms); the Python hashing loop for comparison; and the mirror's lag behind a flood of block events
   (with decisions going on meanwhile). No node processes.
2. policies: Redis, prefill and decode node processes, and one gateway process per policy on the same
   load: tenants sharing long system prompts, each request a fresh user turn. Prefix-cache hit ratio (the
   gateway's kvrelay:prefix_hit_tokens / kvrelay:prompt_tokens) and TTFT p50/p90, cache_aware against
   round_robin. Each policy runs under its own cache_salt, so neither inherits the other's cache.
3. overhead: TTFT through the gateway minus TTFT calling the decode node directly, for the same short
   prompt that the decode node prefills itself, requests alternating; p50 (target: <= 2 ms).

The default model is a small random llama carrying the default model's tokenizer (built once into the
kvrelay cache): big enough that a prefix hit visibly saves compute, small enough for two CPU cores.

    python -m kvrelay.bench.routing                   # all three, JSON to stdout and bench/results/routing.json
    python -m kvrelay.bench.routing --skip-policies --skip-overhead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import time
from pathlib import Path

from kvrelay.bench.report import emit
from kvrelay.common.hashing import prompt_block_hashes

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = "bench/results/routing.json"
BLOCK_SIZE = 16


HELP = "routing decision time, cache_aware vs round_robin, gateway overhead"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small",
                   help="'small' (random llama with the default tokenizer), 'default', or a model folder")
    p.add_argument("--prefill", type=int, default=3, help="prefill node processes")
    p.add_argument("--decode", type=int, default=2, help="decode node processes")
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=768, help="length of each tenant's system prompt")
    p.add_argument("--requests", type=int, default=96, help="requests per policy")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--decision-nodes", type=int, default=100)
    p.add_argument("--decision-tokens", type=int, default=4096)
    p.add_argument("--decision-iters", type=int, default=2000)
    p.add_argument("--overhead-iters", type=int, default=200)
    p.add_argument("--skip-decision", action="store_true")
    p.add_argument("--skip-policies", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=DEFAULT_OUTPUT)


def _socket_path() -> str:
    # A unix socket, as `kvrelay up` runs its Redis: the lookup is one round trip per request.
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="kvrelay-bench-"), "redis.sock")


def percentiles(samples: list[float], scale: float = 1000.0) -> dict[str, float]:
    """p50/p90/p99 (milliseconds by default) of samples in seconds."""
    s = sorted(samples)
    pick = lambda q: round(s[min(len(s) - 1, int(q * len(s)))] * scale, 4)
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "n": len(s)}


# ------------------------------------------------------------------------------------------- decision


def bench_decision(num_nodes: int, num_tokens: int, iters: int, seed: int, lag_seconds: float = 3.0) -> dict:
    """Router.route on a populated Redis index, looking up in the gateway's in-process mirror and with a
    Redis round trip per decision; the nodes exist only as registrations in the router's view. Then the
    mirror's lag behind the nodes' events while a publisher floods the index (and decisions go on)."""
    from kvrelay.common.records import BlockEvent, BlockEventKind, NodeLoad
    from kvrelay.gateway.discovery import Discovery, DiscoveryConfig, Node
    from kvrelay.gateway.node_client import NodeClients
    from kvrelay.gateway.policies import make_policy
    from kvrelay.gateway.router import Router
    from kvrelay.index import create_index
    from kvrelay.index.redis_server import start_redis

    model_id = "bench-routing"
    rng = random.Random(seed)
    tenants = [[rng.randrange(40000) for _ in range(num_tokens * (t + 1) // 4)] for t in range(4)]
    nodes = [Node(f"node-{i:03d}", "prefill" if i % 2 else "decode", f"127.0.0.1:{20000 + i}", model_id,
                  BLOCK_SIZE, "registry",
                  load=NodeLoad(num_running=rng.randrange(8), queued_prefill_tokens=rng.randrange(4096),
                                free_kv_blocks=10_000, total_kv_blocks=10_000))
             for i in range(num_nodes)]
    queries = [t + [rng.randrange(40000) for _ in range(num_tokens - len(t))] for t in tenants for _ in range(4)]
    result: dict = {}
    with start_redis(_socket_path()) as server:
        index = create_index(server.url, model_id, backend="redis")
        for node in nodes:  # each node holds a random prefix of a few tenants' prompts, plus unrelated blocks
            held = [h for t in tenants if rng.random() < 0.75
                    for h in prompt_block_hashes(t, model_id, BLOCK_SIZE)[: rng.randint(1, len(t) // BLOCK_SIZE)]]
            held += [rng.randbytes(16) for _ in range(500)]
            index.apply(node.node_id, [BlockEvent(BlockEventKind.STORED, h) for h in held])
        mirror = create_index(server.url, model_id, backend="mirror")
        if not (mirror.wait_ready(10) and mirror.sync(10)):
            raise RuntimeError(f"the index mirror did not load: {mirror.stats()}")
        discovery = Discovery(DiscoveryConfig(model_id=model_id, block_size=BLOCK_SIZE), NodeClients())
        discovery._registered = {n.node_id: n for n in nodes}
        routers = {name: Router(discovery, make_policy("cache_aware"), idx, local_prefill_threshold=64)
                   for name, idx in (("mirror", mirror), ("redis", index))}
        for name, router in routers.items():
            result[name] = asyncio.run(_time_decisions(router, index, queries, iters))
            assert_same = [router.index.lookup(prompt_block_hashes(q, model_id, BLOCK_SIZE)) for q in queries]
            result[name]["lookups"] = assert_same
        if result["mirror"].pop("lookups") != result["redis"].pop("lookups"):
            raise RuntimeError("the mirror's lookups differ from Redis's")
        result["hash_python_ms"] = _time_python_hashing(queries, model_id, iters)
        result["mirror_under_load"] = _mirror_lag(index, mirror, routers["mirror"], queries, lag_seconds, rng)
        mirror.close()
        index.close()
    result.update(num_nodes=num_nodes, prompt_tokens=num_tokens, iters=iters, target_p99_ms=0.5)
    result["meets_target"] = result["mirror"]["total_ms"]["p99"] <= 0.5
    return result


async def _time_decisions(router, index, queries: list[list[int]], iters: int) -> dict:
    """Wall-clock percentiles of route() and of its parts, plus CPU time per decision on each side: on a
    busy machine wall time includes waiting to be scheduled; the CPU times are what an idle one would see."""
    parts: dict[str, list[float]] = {"total": [], "hash": [], "lookup": [], "score": []}
    prefill, decode = router.discovery.routable("prefill"), router.discovery.routable("decode")
    for q in queries:  # warm-up: connection, script cache
        await router.route(q)
    server_cpu, client_cpu = _redis_cpu_s(index), time.process_time()
    for i in range(iters):
        t0 = time.perf_counter()
        await router.route(queries[i % len(queries)])
        parts["total"].append(time.perf_counter() - t0)
    client_cpu, server_cpu = time.process_time() - client_cpu, _redis_cpu_s(index) - server_cpu
    for i in range(iters):
        q = queries[i % len(queries)]
        t1 = time.perf_counter()
        hashes = prompt_block_hashes(q, router.model_id, router.block_size)
        t2 = time.perf_counter()
        hits = router.index.lookup(hashes)
        t3 = time.perf_counter()
        router.decide(q, hashes, hits, prefill, decode)
        t4 = time.perf_counter()
        for key, dt in (("hash", t2 - t1), ("lookup", t3 - t2), ("score", t4 - t3)):
            parts[key].append(dt)
    out = {f"{k}_ms": percentiles(v) for k, v in parts.items()}
    out["cpu_per_decision_ms"] = {"gateway": round(client_cpu / iters * 1000, 4),
                                  "redis": round(server_cpu / iters * 1000, 4),
                                  "total": round((client_cpu + server_cpu) / iters * 1000, 4)}
    return out


def _time_python_hashing(queries: list[list[int]], model_id: str, iters: int) -> dict:
    """The portable per-block Python loop (the hashing before the native chain), for comparison."""
    from kvrelay.common.hashing import _hash_blocks_py, root_hash

    root = root_hash(model_id, BLOCK_SIZE)
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        _hash_blocks_py(queries[i % len(queries)], BLOCK_SIZE, root)
        samples.append(time.perf_counter() - t0)
    return percentiles(samples)


def _mirror_lag(index, mirror, router, queries: list[list[int]], seconds: float, rng: random.Random) -> dict:
    """A publisher thread applies batches of 64 events (stores, then evictions of the same blocks) from 100
    nodes as fast as Redis takes them for `seconds`, while decisions run on the mirror. Lag: the time from
    an event's write in Redis (its stream entry id) to its application in the mirror."""
    import threading

    from kvrelay.common.records import BlockEvent, BlockEventKind

    stop, sent = threading.Event(), [0]
    batches = [[rng.randbytes(16) for _ in range(64)] for _ in range(32)]

    def publish() -> None:
        i = 0
        while not stop.is_set():
            kind = BlockEventKind.STORED if (i // 100) % 2 == 0 else BlockEventKind.EVICTED
            index.apply(f"load-{i % 100:03d}", [BlockEvent(kind, h) for h in batches[i % len(batches)]])
            sent[0] += 64
            i += 1

    mirror.lag_ms.clear()
    before = mirror.stats()["events"]
    thread = threading.Thread(target=publish, daemon=True)
    decisions: list[float] = []
    t0 = time.perf_counter()
    thread.start()

    async def decide() -> None:
        while time.perf_counter() - t0 < seconds:
            t1 = time.perf_counter()
            await router.route(queries[len(decisions) % len(queries)])
            decisions.append(time.perf_counter() - t1)
            await asyncio.sleep(0.001)  # a gateway also serves requests: leave the follower some GIL

    asyncio.run(decide())
    stop.set()
    thread.join()
    elapsed = time.perf_counter() - t0
    synced = mirror.sync(10)
    lags = sorted(mirror.lag_ms)
    return {"events_per_s": round(sent[0] / elapsed), "entries_applied": mirror.stats()["events"] - before,
            "lag_ms": percentiles([x / 1000 for x in lags]) if lags else None, "caught_up": synced,
            "decision_ms": percentiles(decisions), "gaps": mirror.stats()["gaps"]}


def _redis_cpu_s(index) -> float:
    cpu = index.client.info("cpu")  # the direct index's client: the mirror's Redis is the same server
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"]


# ------------------------------------------------------------------------------------------- policies


def tenant_prompts(tokenizer, tenants: int, system_tokens: int, seed: int) -> list[str]:
    """Distinct system prompts of about `system_tokens` tokens (real words, so the template tokenizes them
    like text)."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.decode(list(range(1000, 9000))).split() if w.isalpha()]
    out = []
    for t in range(tenants):
        text = f"You are assistant {t} of tenant {rng.randrange(10**6)}."
        while len(tokenizer.encode(text)) < system_tokens:
            text += " " + " ".join(rng.choice(words) for _ in range(32))
        out.append(text)
    return out


def bench_policies(fleet, policies: list[str], args) -> dict:
    tok = fleet.tokenizer
    systems = tenant_prompts(tok, args.tenants, args.system_tokens, args.seed)
    rng = random.Random(args.seed + 1)
    order = [i % args.tenants for i in range(args.requests)]
    rng.shuffle(order)
    questions = [f"Question {i}: what is {rng.randrange(1000)} plus {rng.randrange(1000)}?" for i in order]
    out = {}
    for policy in policies:
        with fleet.gateway(routing_policy=policy) as gw:
            out[policy] = asyncio.run(_run_load(gw, systems, order, questions, args, salt=f"{policy}-{args.seed}"))
        logger.info("%s: %s", policy, {k: v for k, v in out[policy].items() if k != "nodes"})
    return out


async def _run_load(gw, systems, order, questions, args, salt: str) -> dict:
    import httpx

    before = gw.scrape()
    sem = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    nodes: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=gw.url, timeout=300) as http:
        async def one(tenant: int, question: str) -> None:
            body = {"messages": [{"role": "system", "content": systems[tenant]}, {"role": "user", "content": question}],
                    "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True, "cache_salt": salt,
                    "temperature": 0}
            async with sem:
                t0 = time.perf_counter()
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    key = f"{r.headers.get('x-kvrelay-prefill-node')}->{r.headers.get('x-kvrelay-decode-node')}"
                    nodes[key] = nodes.get(key, 0) + 1
                    lines = r.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                            ttfts.append(time.perf_counter() - t0)
                            break
                    async for _ in lines:
                        pass

        t0 = time.perf_counter()
        await asyncio.gather(*(one(t, q) for t, q in zip(order, questions)))
        wall = time.perf_counter() - t0
    after = gw.scrape()
    hits = _total(after, "kvrelay:prefix_hit_tokens_total") - _total(before, "kvrelay:prefix_hit_tokens_total")
    prompt = _total(after, "kvrelay:prompt_tokens_total") - _total(before, "kvrelay:prompt_tokens_total")
    return {"prefix_hit_ratio": round(hits / prompt, 4) if prompt else 0.0, "ttft_ms": percentiles(ttfts),
            "requests": len(order), "wall_s": round(wall, 2), "nodes": dict(sorted(nodes.items()))}


def _total(samples: dict[str, float], name: str) -> float:
    """A metric summed over its label sets."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


# ------------------------------------------------------------------------------------------- overhead


def bench_overhead(fleet, iters: int) -> dict:
    """Alternate the same request through the gateway and straight to the decode node the gateway picks.

    Both sides use a minimal client (grpc's C core; raw HTTP/1.1 on one kept-alive socket), so the
    difference is the gateway's, not a client library's."""
    import grpc

    from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
    from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

    ids = fleet.tokenizer.encode("Hello, how are you today?")
    params = pb.SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=1, ignore_eos=True, repetition_penalty=1.0)
    direct, through = [], []
    with fleet.gateway(routing_policy="cache_aware") as gw:
        conn = _RawHttp(gw.port)
        body = json.dumps({"prompt": ids, "max_tokens": 1, "stream": True, "temperature": 0, "ignore_eos": True})

        def via_gateway() -> tuple[float, str]:
            return conn.post_until_event("/v1/completions", body.encode())

        _, node_id = via_gateway()
        stub = pb_grpc.EngineStub(grpc.insecure_channel(fleet.address_of(node_id)))

        def via_node(i: int) -> float:
            t0 = time.perf_counter()
            req = pb.GenerateRequest(request_id=f"bench-direct-{i}-{time.time_ns()}", prompt_token_ids=ids,
                                     params=params)
            for _ in stub.Generate(req, timeout=60):
                return time.perf_counter() - t0
            raise RuntimeError("no token from the node")

        for i in range(20):  # warm-up
            via_gateway(), via_node(i)
        cpu0 = _process_cpu_s(gw.proc.pid)
        for i in range(iters):
            dt, chosen = via_gateway()
            if chosen == node_id:
                through.append(dt)
            direct.append(via_node(i))
        cpu = _process_cpu_s(gw.proc.pid) - cpu0
        conn.close()
    d, g = percentiles(direct), percentiles(through)
    overhead = round(g["p50"] - d["p50"], 3)
    return {"direct_ttft_ms": d, "gateway_ttft_ms": g, "overhead_p50_ms": overhead, "target_ms": 2.0,
            "meets_target": overhead <= 2.0, "prompt_tokens": len(ids),
            "gateway_cpu_per_request_ms": round(cpu / iters * 1000, 3)}


class _RawHttp:
    """POST on one kept-alive socket and time until the first SSE event arrives (http.client alone parses
    headers with the email package, a sizeable share of a millisecond)."""

    def __init__(self, port: int) -> None:
        import re
        import socket

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._node = re.compile(rb"x-kvrelay-decode-node: ([^\r]+)", re.I)

    def post_until_event(self, path: str, body: bytes) -> tuple[float, str]:
        head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        request = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        t0 = time.perf_counter()
        self.sock.sendall(request)
        buf = b""
        while b"data: {" not in buf:
            buf += self._recv()
        dt = time.perf_counter() - t0
        while not buf.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body: the response is over
            buf += self._recv()
        match = self._node.search(buf)
        return dt, match.group(1).decode() if match else ""

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise RuntimeError("the gateway closed the connection")
        return data

    def close(self) -> None:
        self.sock.close()


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_speed_ms() -> float:
    """Milliseconds for a million-iteration Python loop: on a shared machine, read latencies against it
    (an idle core of this class takes ~40 ms)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i
    return round((time.perf_counter() - t0) * 1000, 1)


# ---------------------------------------------------------------------------------------------- fleet


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                    "special_tokens_map.json")


def small_model() -> Path:
    """A random llama (4 layers, hidden 256) with the default model's tokenizer, built once into the cache."""
    import shutil

    from kvrelay.common.system import cache_dir
    from kvrelay.model_files.resolve import resolve_model

    path = cache_dir() / "bench" / "small-random-llama-v1"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
    source = resolve_model("default").path
    for name in _TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, tmp / name)
    os.replace(tmp, path)  # published whole, or not at all
    return path


class Fleet:
    """Redis, registered node processes, and gateway processes on demand; everything stopped on exit."""

    def __init__(self, model: str, num_prefill: int, num_decode: int) -> None:
        from kvrelay.common.tokenizer import Tokenizer
        from kvrelay.model_files.resolve import resolve_model

        resolved = resolve_model(str(small_model()) if model == "small" else model)
        self.model_path, self.model_id = str(resolved.path), resolved.model_id
        self.tokenizer = Tokenizer(resolved.path)
        self.counts = {"prefill": num_prefill, "decode": num_decode}
        self.redis = None
        self.nodes: list = []

    def __enter__(self) -> Fleet:
        from kvrelay.index.redis_server import start_redis
        from kvrelay.node.launch import NodeProcess

        self.redis = start_redis(_socket_path())
        common = ["--model", self.model_path, "--dtype", "float32", "--num-threads", "1", "--connector", "ucx",
                  "--block-size", str(BLOCK_SIZE), "--kv-cache-memory", str(256 * 2**20), "--redis-url",
                  self.redis.url, "--heartbeat-seconds", "0.5", "--max-num-batched-tokens", "1024"]
        specs = [(role, [*common, "--node-id", f"{role}-{i}"]) for role, n in self.counts.items() for i in range(n)]
        try:
            self.nodes = NodeProcess.start_many(specs, env={"OMP_NUM_THREADS": "1"}, timeout=300)
        except BaseException:
            self.redis.stop()
            raise
        return self

    def address_of(self, node_id: str) -> str:
        return next(n.address for n in self.nodes if n.info.get("node_id") == node_id)

    def gateway(self, **flags):
        from kvrelay.gateway.launch import GatewayProcess

        argv = ["--model", self.model_path, "--redis-url", self.redis.url, "--refresh-interval", "0.2"]
        for key, value in flags.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        return GatewayProcess(argv, num_nodes=sum(self.counts.values()))

    def __exit__(self, *exc) -> None:
        for node in self.nodes:
            node.terminate()
        for node in self.nodes:
            node.stop(20)
        self.redis.stop()


# ----------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    result: dict = {"bench": "routing", "host": platform.node(), "cpus": os.cpu_count(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result["loop_1m_ms_before"] = machine_speed_ms()
    if not args.skip_decision:
        result["decision"] = bench_decision(args.decision_nodes, args.decision_tokens, args.decision_iters, args.seed)
    if not (args.skip_policies and args.skip_overhead):
        with Fleet(args.model, args.prefill, args.decode) as fleet:
            result["model"] = fleet.model_id
            if not args.skip_policies:
                result["policies"] = bench_policies(fleet, args.policies.split(","), args)
                result["policies"]["workload"] = {"tenants": args.tenants, "system_tokens": args.system_tokens,
                                                  "requests": args.requests, "concurrency": args.concurrency,
                                                  "prefill_nodes": args.prefill, "decode_nodes": args.decode}
            if not args.skip_overhead:
                result["overhead"] = bench_overhead(fleet, args.overhead_iters)
    result["loop_1m_ms_after"] = machine_speed_ms()
    emit(result, args.output)
    return 0

