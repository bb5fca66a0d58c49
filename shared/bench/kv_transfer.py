"""KV transfer throughput of each connector and transport, against a plain memcpy of the same bytes.

Moves the KV of N blocks for every layer of a SmolLM2-shaped cache (block 16, 3 KV heads, head 64, bf16)
between two processes, layer by layer as a prefill node does, and times each transfer from the first
send_blocks() to the acknowledged wait(). Each connector allocates its caches where it wants them
(kv_allocator(): shared memory for shm and auto), as a node's engine does. Prints JSON, each connector's
ratio to a memcpy of the same bytes timed in the same invocation, and writes it to --output.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import time

import torch
from tqdm import tqdm

from kvrelay.bench.report import emit
from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer.harness import PeerProcess, make_caches
from kvrelay.kv_transfer.local import LocalConnector
from kvrelay.kv_transfer.types import ConnectorConfig

logger = logging.getLogger(__name__)

# case -> (connector name, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "local": ("local", {}),
    "shm": ("shm", {}),
    "shm-2threads": ("shm", {"copy_threads": 2}),
    "auto": ("auto", {}),
    "ucx-tcp": ("ucx", {"transport": "tcp"}),
    "ucx-shm": ("ucx", {"transport": "shm"}),
    "gloo": ("nccl", {"backend": "gloo"}),
}


_TRANSPORTS = {"local": "in-process", "shm": "shared memory", "auto": "shared memory (same host)"}

HELP = "KV transfer GB/s per connector between two processes, and each one's ratio to memcpy"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "GB/s are 1e9 bytes of KV payload per second; ratio_to_memcpy = best GB/s / memcpy best GB/s."
    default = ",".join(c for c in CASES if c != "shm-2threads")
    p.add_argument("--connectors", default=default, help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--layers", type=int, default=30, help="model layers (SmolLM2-135M has 30)")
    p.add_argument("--blocks", type=int, default=180, help="blocks per transfer (180 x 30 layers ~ 66 MB)")
    p.add_argument("--cache-blocks", type=int, default=400, help="blocks per layer cache on each side")
    p.add_argument(
        "--pattern",
        choices=["scattered", "contiguous", "both"],
        default="both",
        help="block ids: random (gathered/scattered through staging) or one run (sent/received in place)",
    )
    p.add_argument(
        "--max-message-kib",
        type=int,
        default=None,
        help="cap on one wire message (default: the config's, 1024)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per case (after one warm-up)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per transfer")
    p.add_argument("--output", default="bench/results/kv_transfer.json", help="where to write the JSON")


def pick_blocks(pattern: str, blocks: int, cache_blocks: int, seed: int = 0) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(blocks)), list(range(cache_blocks - blocks, cache_blocks))
    rng = random.Random(seed)
    return rng.sample(range(cache_blocks), blocks), rng.sample(range(cache_blocks), blocks)


def memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return seconds


def local_seconds(
    layout: KVLayout, src: list[int], dst: list[int], args: argparse.Namespace, bar
) -> list[float]:
    sender, receiver = LocalConnector(ConnectorConfig()), LocalConnector(ConnectorConfig())
    sender.register_kv_caches(layout, make_caches(layout, 1))
    receiver.register_kv_caches(layout, make_caches(layout, None))
    seconds = []
    for i in range(args.repeats + 1):
        receiver.expect(f"t{i}", dst)
        start = time.perf_counter()
        for layer in range(layout.num_layers):
            sender.send_blocks(receiver.address, f"t{i}", layer, src, dst)
        sender.wait(f"t{i}", args.timeout)
        seconds.append(time.perf_counter() - start)
        receiver.wait_received(f"t{i}", args.timeout)
        bar.update(i > 0)
    sender.close()
    receiver.close()
    return seconds[1:]


def wire_seconds(
    hosts: tuple[PeerProcess, PeerProcess],
    case: str,
    layout: KVLayout,
    src: list[int],
    dst: list[int],
    args,
    bar,
) -> list[float]:
    sender_host, receiver_host = hosts
    name, overrides = CASES[case]
    config = ConnectorConfig(name=name, transfer_timeout=args.timeout, **overrides)
    if args.max_message_kib:
        config.max_message_bytes = args.max_message_kib << 10
    address = receiver_host.create("rx", name, config, layout, None)
    sender_host.create("tx", name, config, layout, 1)
    seconds = []
    try:
        for i in range(args.repeats + 1):  # the first one also pays for connecting
            receiver_host.call("expect", "rx", f"t{i}", dst)
            took = sender_host.call("timed_sends", "tx", address, [f"t{i}"], src, dst, args.timeout)
            receiver_host.call("wait_received", "rx", f"t{i}", args.timeout)
            seconds += took
            bar.update(i > 0)
    finally:
        sender_host.call("close", "tx")
        receiver_host.call("close", "rx")
    return seconds[1:]


def summarize(case: str, pattern: str, nbytes: int, seconds: list[float], memcpy_best: float) -> dict:
    best, median = nbytes / min(seconds) / 1e9, nbytes / statistics.median(seconds) / 1e9
    name, overrides = CASES.get(case, (case, {}))
    return {
        "case": case,
        "connector": name,
        "transport": overrides.get("transport") or overrides.get("backend") or _TRANSPORTS.get(name, name),
        "pattern": pattern,
        "gbps_best": round(best, 3),
        "gbps_median": round(median, 3),
        "ratio_to_memcpy": round(best / memcpy_best, 4),
        "seconds": [round(s, 5) for s in seconds],
    }


def run(args: argparse.Namespace) -> int:
    cases = [c.strip() for c in args.connectors.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown connectors {unknown}; choose from {', '.join(CASES)}")
    patterns = ["scattered", "contiguous"] if args.pattern == "both" else [args.pattern]
    layout = KVLayout("smollm2-shaped", "bfloat16", 16, args.layers, 3, 64, args.cache_blocks)
    nbytes = layout.transfer_nbytes(args.blocks)
    memcpy = memcpy_seconds(nbytes, max(args.repeats, 5))
    memcpy_best = nbytes / min(memcpy) / 1e9
    rows = []
    total = len(cases) * len(patterns) * args.repeats
    hosts: tuple[PeerProcess, PeerProcess] | None = None
    with tqdm(total=total, desc="kv transfer", unit="transfer") as bar:
        try:
            for case in cases:
                for pattern in patterns:
                    bar.set_postfix_str(f"{case} {pattern}")
                    src, dst = pick_blocks(pattern, args.blocks, args.cache_blocks)
                    if case == "local":
                        seconds = local_seconds(layout, src, dst, args, bar)
                    else:
                        # Started on first use: two processes importing torch would skew the local case.
                        hosts = hosts or (PeerProcess(), PeerProcess())
                        seconds = wire_seconds(hosts, case, layout, src, dst, args, bar)
                    rows.append(summarize(case, pattern, nbytes, seconds, memcpy_best))
        finally:
            for host in hosts or ():
                host.close()
    report = {
        "benchmark": "kv_transfer",
        "layout": layout.to_dict(),
        "blocks_per_transfer": args.blocks,
        "bytes_per_transfer": nbytes,
        "repeats": args.repeats,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__},
        "memcpy": {"gbps_best": round(memcpy_best, 3), "seconds": [round(s, 5) for s in memcpy]},
        "results": rows,
    }
    emit(report, args.output)
    return 0

