"""Lookup latency of the Redis index, the gateway's per-request routing query.

Data: 4 tenants whose system prompts fill 1/4, 2/4, 3/4 and all of a `num_blocks` prompt; every node holds
each tenant's prompt with probability 3/4, up to a random length, plus `noise_blocks` unrelated blocks.
Queries: a tenant's system prompt followed by a fresh user turn, `num_blocks` blocks in all.

    python -m kvrelay.bench.index_lookup                      # starts a throw-away redis-server on a unix socket
    python -m kvrelay.bench.index_lookup --url unix:///run/kvrelay/redis.sock --compare-set
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.records import BlockEvent, BlockEventKind
from kvrelay.index.redis_index import RedisIndex

BLOCK_SIZE = 16

# The same walk over a layout of Redis SETs of node ids (KEYS: block keys): SMISMEMBER of the still-matching
# nodes, one call per block. Kept to measure what the bitmap layout buys.
SET_LOOKUP_LUA = """
local active = redis.call('SMEMBERS', KEYS[1])
local out, i = {}, 2
while #active > 0 and i <= #KEYS do
  local r = redis.call('SMISMEMBER', KEYS[i], unpack(active))
  local keep = {}
  for j = 1, #r do
    if r[j] == 1 then keep[#keep + 1] = active[j] else out[#out + 1] = active[j]; out[#out + 1] = i - 1 end
  end
  active, i = keep, i + 1
end
for _, node in ipairs(active) do out[#out + 1] = node; out[#out + 1] = i - 1 end
return out
"""


def _prompt(rng: random.Random, num_blocks: int, salt: str) -> list[bytes]:
    tokens = [rng.randrange(50_000) for _ in range(num_blocks * BLOCK_SIZE)]
    return prompt_block_hashes(tokens, "bench", BLOCK_SIZE, salt)


def build_workload(
    num_nodes: int, num_blocks: int, noise_blocks: int, seed: int
) -> tuple[dict[str, list[bytes]], list[list[bytes]]]:
    """(node id -> hashes it holds, query prompts)."""
    rng = random.Random(seed)
    tenants = [_prompt(rng, num_blocks, f"tenant-{t}")[: num_blocks * (t + 1) // 4] for t in range(4)]
    held: dict[str, list[bytes]] = {}
    for n in range(num_nodes):
        blocks = [h for sp in tenants if rng.random() < 0.75 for h in sp[: rng.randint(1, len(sp))]]
        blocks += [rng.randbytes(16) for _ in range(noise_blocks)]
        held[f"node-{n:03d}"] = blocks
    queries = []
    for q in range(16):
        sp = tenants[q % 4]
        # The user turn continues the system prompt's chain, so it is a fresh suffix nobody holds.
        queries.append(sp + [rng.randbytes(16) for _ in range(num_blocks - len(sp))])
    return held, queries


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    pick = lambda q: round(s[min(len(s) - 1, int(q * len(s)))] / 1000, 1)
    return {"p50_us": pick(0.50), "p90_us": pick(0.90), "p99_us": pick(0.99), "max_us": round(s[-1] / 1000, 1)}


def _server_cpu_s(index: RedisIndex) -> float:
    cpu = index.client.info("cpu")
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"]


def _time(index: RedisIndex, fn, queries: Sequence[list[bytes]], iters: int) -> dict[str, float]:
    """Latency percentiles, plus CPU time per call on each side: on a busy machine the latency includes
    waiting to be scheduled, the CPU times do not (their sum is what an idle machine would see)."""
    for q in queries:  # warm-up: connection, script cache
        fn(q)
    samples = []
    index.client.config_resetstat()
    server_cpu, client_cpu = _server_cpu_s(index), time.process_time()
    for i in range(iters):
        q = queries[i % len(queries)]
        t0 = time.perf_counter_ns()
        fn(q)
        samples.append(time.perf_counter_ns() - t0)
    client_cpu = time.process_time() - client_cpu
    server_cpu = _server_cpu_s(index) - server_cpu
    out = _percentiles(samples)
    out["client_cpu_us"] = round(client_cpu / iters * 1e6, 1)
    out["server_cpu_us"] = round(server_cpu / iters * 1e6, 1)
    stats = index.client.info("commandstats").get("cmdstat_evalsha")
    out["server_script_us"] = stats["usec_per_call"] if stats else None
    return out


def _set_layout_lookup(index: RedisIndex, held: dict[str, list[bytes]], prefix: str):
    pipe = index.client.pipeline(transaction=False)
    for node, blocks in held.items():
        for h in blocks:
            pipe.sadd(prefix + h.hex(), node)
        pipe.execute()
    script = index.client.register_script(SET_LOOKUP_LUA)
    return lambda q: script(keys=[prefix + h.hex() for h in q])


def bench_lookup(
    url: str,
    num_nodes: int = 100,
    num_blocks: int = 256,
    iters: int = 2000,
    *,
    noise_blocks: int = 1000,
    seed: int = 0,
    compare_set: bool = False,
) -> dict:
    """p50/p99 (microseconds, client side, one lookup at a time) of `RedisIndex.lookup` for a
    `num_blocks`-block prompt with `num_nodes` nodes registered. Writes under a throw-away model id."""
    model_id = f"bench-{uuid.uuid4().hex[:8]}"
    index = RedisIndex(url, model_id)
    held, queries = build_workload(num_nodes, num_blocks, noise_blocks, seed)
    try:
        for node, blocks in held.items():
            for i in range(0, len(blocks), 2000):
                index.apply(node, [BlockEvent(BlockEventKind.STORED, h) for h in blocks[i : i + 2000]])
        hits = [index.lookup(q) for q in queries]
        result = _time(index, index.lookup, queries, iters)
        result |= {"num_nodes": num_nodes, "num_blocks": num_blocks, "iters": iters}
        result["mean_nodes_matched"] = round(sum(len(h) for h in hits) / len(hits), 1)
        result["mean_blocks_matched_per_node"] = round(
            sum(sum(h.values()) for h in hits) / max(1, sum(len(h) for h in hits)), 1
        )
        if compare_set:
            set_lookup = _set_layout_lookup(index, held, f"kvr:{{{model_id}}}:setb:")
            result["set_layout"] = _time(index, set_lookup, queries, max(100, iters // 4))
        return result
    finally:
        _cleanup(index, list(held))
        index.close()


def _cleanup(index: RedisIndex, nodes: list[str]) -> None:
    for node in nodes:
        index.clear_node(node)
    keys = list(index.client.scan_iter(match=index.keys.prefix.replace("{", "\\{").replace("}", "\\}") + "*"))
    for i in range(0, len(keys), 1000):
        index.client.delete(*keys[i : i + 1000])


HELP = "Redis block-index lookup latency (100 nodes, a 4,096-token prompt), inside Redis and round trip"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="Redis URL (default: start a throw-away redis-server on a unix socket)")
    p.add_argument("--nodes", type=int, default=100, help="nodes holding blocks")
    p.add_argument("--blocks", type=int, default=256, help="prompt blocks looked up (256 x 16 = 4,096 tokens)")
    p.add_argument("--iters", type=int, default=2000, help="timed lookups")
    p.add_argument("--noise-blocks", type=int, default=1000, help="unrelated blocks each node also holds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-set", action="store_true", help="also time the same walk over Redis SETs")


def run(args: argparse.Namespace) -> int:
    kwargs = dict(noise_blocks=args.noise_blocks, seed=args.seed, compare_set=args.compare_set)
    if args.url:
        result = bench_lookup(args.url, args.nodes, args.blocks, args.iters, **kwargs)
    else:
        from kvrelay.index.redis_server import start_redis

        with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as tmp:
            with start_redis(os.path.join(tmp, "redis.sock")) as server:
                result = bench_lookup(server.url, args.nodes, args.blocks, args.iters, **kwargs)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0

