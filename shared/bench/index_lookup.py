"""`kvrelay bench index-lookup`: latency of the Redis block index's lookup, the gateway's per-request routing
query, and the index workload `bench routing` shares.

Data: 4 tenants whose system prompts fill 1/4, 2/4, 3/4 and all of a prompt; every node holds each tenant's
prompt with probability 3/4, up to a random length, plus `noise_blocks` unrelated blocks. Queries: a tenant's
system prompt followed by a fresh user turn, the whole prompt long. Timed one lookup at a time: latency, and the
CPU time per call on each side (on a busy machine latency includes waiting to be scheduled; the CPU times do
not, and their sum is what an idle machine would see).

    kvrelay bench index-lookup                      # starts a throw-away redis-server on a unix socket
    kvrelay bench index-lookup --url unix:///run/kvrelay/redis.sock --compare-set
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvrelay.bench.report import emit
from kvrelay.bench.stats import percentiles
from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.records import BlockEvent, BlockEventKind
from kvrelay.index.redis_index import RedisIndex

BLOCK_SIZE = 16
HELP = "Redis block-index lookup latency (100 nodes, a 4,096-token prompt), inside Redis and round trip"

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


@dataclass
class IndexWorkload:
    model_id: str
    held: dict[str, list[bytes]]  # node id -> the block hashes it holds
    queries: list[list[int]]  # prompts (token ids)

    def query_hashes(self) -> list[list[bytes]]:
        return [prompt_block_hashes(q, self.model_id, BLOCK_SIZE) for q in self.queries]

    def store(self, index) -> None:
        for node, blocks in self.held.items():
            for i in range(0, len(blocks), 2000):
                index.apply(node, [BlockEvent(BlockEventKind.STORED, h) for h in blocks[i:i + 2000]])


def index_workload(model_id: str, num_nodes: int, num_tokens: int, noise_blocks: int, seed: int) -> IndexWorkload:
    rng = random.Random(seed)
    tenants = [[rng.randrange(50_000) for _ in range(num_tokens * (t + 1) // 4)] for t in range(4)]
    hashes = [prompt_block_hashes(t, model_id, BLOCK_SIZE) for t in tenants]
    held = {f"node-{n:03d}": [h for hs in hashes if rng.random() < 0.75 for h in hs[:rng.randint(1, len(hs))]]
            + [rng.randbytes(16) for _ in range(noise_blocks)] for n in range(num_nodes)}
    # The user turn continues the system prompt's chain, so it is a fresh suffix nobody holds.
    queries = [t + [rng.randrange(50_000) for _ in range(num_tokens - len(t))] for t in tenants for _ in range(4)]
    return IndexWorkload(model_id, held, queries)


def redis_cpu_s(client) -> float:
    cpu = client.info("cpu")
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"]


async def time_calls(fn: Callable[[object], Awaitable], args: list, iters: int, redis_client,
                     scale: float = 1000.0) -> dict:
    """Latency percentiles (x scale: ms by default) of `await fn(arg)` cycling through args, one at a time, and
    CPU time per call in this process and in Redis."""
    for a in args:  # warm-up: connection, script cache
        await fn(a)
    samples, server, client = [], redis_cpu_s(redis_client), time.process_time()
    for i in range(iters):
        t0 = time.perf_counter()
        await fn(args[i % len(args)])
        samples.append(time.perf_counter() - t0)
    client, server = time.process_time() - client, redis_cpu_s(redis_client) - server
    return {**percentiles(samples, scale, digits=4), "max": round(max(samples) * scale, 4),
            "n": iters, "cpu_per_call": {"client": round(client / iters * scale, 4),
                                         "redis": round(server / iters * scale, 4)}}


def bench_lookup(url: str, num_nodes: int = 100, num_blocks: int = 256, iters: int = 2000, *, noise_blocks: int = 1000,
                 seed: int = 0, compare_set: bool = False) -> dict:
    """p50/p90/p99 (microseconds, client side, one lookup at a time) of `RedisIndex.lookup` for a
    `num_blocks`-block prompt with `num_nodes` nodes registered. Writes under a throw-away model id."""
    model_id = f"bench-{uuid.uuid4().hex[:8]}"
    index = RedisIndex(url, model_id)
    work = index_workload(model_id, num_nodes, num_blocks * BLOCK_SIZE, noise_blocks, seed)
    queries = work.query_hashes()

    async def lookup(q):
        return index.lookup(q)

    try:
        work.store(index)
        hits = [index.lookup(q) for q in queries]
        index.client.config_resetstat()
        timed = asyncio.run(time_calls(lookup, queries, iters, index.client, 1e6))
        stats = index.client.info("commandstats").get("cmdstat_evalsha")
        result = {**_us(timed), "server_script_us": stats["usec_per_call"] if stats else None,
                  "num_nodes": num_nodes, "num_blocks": num_blocks, "iters": iters,
                  "mean_nodes_matched": round(sum(map(len, hits)) / len(hits), 1),
                  "mean_blocks_matched_per_node": round(sum(sum(h.values()) for h in hits)
                                                        / max(1, sum(map(len, hits))), 1)}
        if compare_set:
            result["set_layout"] = _us(asyncio.run(time_calls(_set_layout_lookup(index, work.held), queries,
                                                              max(100, iters // 4), index.client, 1e6)))
        return result
    finally:
        for node in work.held:
            index.clear_node(node)
        keys = list(index.client.scan_iter(match=index.keys.prefix.replace("{", "\\{").replace("}", "\\}") + "*"))
        for i in range(0, len(keys), 1000):
            index.client.delete(*keys[i:i + 1000])
        index.close()


def _us(timed: dict) -> dict:
    cpu = timed.pop("cpu_per_call")
    return {**{f"{k}_us": v for k, v in timed.items() if k != "n"}, "client_cpu_us": cpu["client"],
            "server_cpu_us": cpu["redis"]}


def _set_layout_lookup(index: RedisIndex, held: dict[str, list[bytes]]):
    prefix = index.keys.prefix + "setb:"
    for node, blocks in held.items():
        pipe = index.client.pipeline(transaction=False)
        for h in blocks:
            pipe.sadd(prefix + h.hex(), node)
        pipe.execute()
    script = index.client.register_script(SET_LOOKUP_LUA)

    async def lookup(q):
        return script(keys=[prefix + h.hex() for h in q])

    return lookup


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="Redis URL (default: start a throw-away redis-server on a unix socket)")
    p.add_argument("--nodes", type=int, default=100, help="nodes holding blocks")
    p.add_argument("--blocks", type=int, default=256, help="prompt blocks looked up (256 x 16 = 4,096 tokens)")
    p.add_argument("--iters", type=int, default=2000, help="timed lookups")
    p.add_argument("--noise-blocks", type=int, default=1000, help="unrelated blocks each node also holds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-set", action="store_true", help="also time the same walk over Redis SETs")
    p.add_argument("--output", default=None, help="also write the JSON here")


def run(args: argparse.Namespace) -> int:
    kwargs = dict(noise_blocks=args.noise_blocks, seed=args.seed, compare_set=args.compare_set)
    if args.url:
        result = bench_lookup(args.url, args.nodes, args.blocks, args.iters, **kwargs)
    else:
        from kvrelay.index.redis_server import start_redis

        with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as tmp, \
                start_redis(os.path.join(tmp, "redis.sock")) as server:
            result = bench_lookup(server.url, args.nodes, args.blocks, args.iters, **kwargs)
    emit(result, args.output)
    return 0
