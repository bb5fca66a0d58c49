"""`kvrelay sim validate`: the simulator against real fleets on this machine, on the same traces.

For each fleet shape (`kvrelay up --colocated`, and 1 prefill + 1 decode node) and request rate, a trace of
tenants with shared prefixes (kvrelay.sim.workloads, small enough for 2 cores) is replayed against the real fleet
through its OpenAI API (streamed completions of the trace's token ids, `ignore_eos`, arrivals on the trace's
clock) and simulated with the `local` profile (threads per node as `kvrelay up` places them, KV blocks as the
fleet's nodes report), after `--warmup` seconds of unmeasured traffic on each fresh fleet. Reported per point:
TTFT p50/p90, ITL p50/p90 and output throughput, real and simulated, and per metric the mean absolute
percentage error over the points. Each rate uses its own prefix groups, so one point's cache does not help the
next.

    kvrelay sim validate                               # needs `kvrelay sim calibrate` first
    kvrelay sim validate --rates 1,2,4 --duration 60 --output bench/results/sim-validate.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kvrelay.sim.fleet import FleetSpec
from kvrelay.sim.results import pct
from kvrelay.sim.run import simulate
from kvrelay.sim.timemodel import Profile, load_profile
from kvrelay.sim.trace import PromptSource, TraceRequest
from kvrelay.sim.workloads import Shape, llmd

logger = logging.getLogger(__name__)

HELP = "the simulator against real `kvrelay up` fleets here: TTFT, ITL, throughput errors"
SHAPES = {"colocated": (["--colocated"], {"colocated": 1}),
          "1p1d": (["--prefill", "1", "--decode", "1"], {"prefill": 1, "decode": 1})}
METRICS = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "output_tok_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="local")
    p.add_argument("--shapes", default="colocated,1p1d")
    p.add_argument("--rates", default="1,2,4", help="requests per second, each a point")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per point")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--up-args", default="", help="more `kvrelay up` flags")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds of traffic at the first rate, not measured, on each fresh fleet (a new fleet's first "
                        "steps of each shape pay one-time costs that the simulator does not model)")
    p.add_argument("--output", default="bench/results/sim-validate.json")


def _stats(ttft: list[float], itl: list[float], output_tokens: int, span_s: float) -> dict:
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "itl_p50_s": pct(itl, 50),
            "itl_p90_s": pct(itl, 90), "output_tok_s": round(output_tokens / span_s, 3) if span_s > 0 else 0.0}


async def replay(base_url: str, model: str, trace: list[TraceRequest]) -> dict:
    """Send the trace on its own clock; the real fleet's figures as the simulator reports them."""
    from kvrelay.bench.client import Client

    source = PromptSource()
    async with Client(base_url) as client:
        t0 = time.perf_counter()

        async def one(i: int, req: TraceRequest):
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            body = {"model": model, "prompt": source.prompt(i, req), "max_tokens": req.output_len,
                    "min_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            return await client.post("completions", body)

        replies = await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
    ok = [r for r in replies if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    out = sum((r.usage or {}).get("completion_tokens", len(r.chunk_times)) for r in ok)
    span = max(r.end for r in ok) - (t0 + trace[0].arrival_s) if ok else 0.0  # from the first arrival, as simulated
    return {**_stats(ttft, itl, out, span), "completed": len(ok), "failed": len(replies) - len(ok)}


async def _served_model(base_url: str) -> str:
    from kvrelay.bench.client import Client

    async with Client(base_url) as client:
        return (await client.models())[0]


def _node_blocks(server) -> int | None:
    samples = server.metrics().select("vllm:cache_config_info")
    blocks = [int(s.labels["num_gpu_blocks"]) for s in samples if s.labels.get("num_gpu_blocks")]
    return min(blocks) if blocks else None


def mape(points: list[dict]) -> dict:
    out = {}
    for m in METRICS:
        errs = [abs(p["sim"][m] - p["real"][m]) / p["real"][m] for p in points
                if p["real"].get(m) and p["sim"].get(m) is not None]
        out[m] = round(float(np.mean(errs)), 4) if errs else None
    return out


def _validate_shape(args: argparse.Namespace, profile: Profile, shape_name: str, rates: list[float],
                    log_dir: Path) -> list[dict]:
    """Each rate's trace served by a real fleet of this shape and simulated: one point per rate."""
    from kvrelay.bench.fleet import Server

    flags, nodes = SHAPES[shape_name]
    threads = len(os.sched_getaffinity(0)) // sum(nodes.values())
    points = []
    with Server.up([*flags, *args.up_args.split()], log_dir=log_dir, name=f"up-{shape_name}") as server:
        model = asyncio.run(_served_model(server.base_url))
        blocks = _node_blocks(server)
        shape = Shape(tenants=args.tenants, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                      output_len=args.output_len)
        if args.warmup > 0:
            warm = llmd(rates[0], args.warmup, args.seed + len(rates), shape)
            asyncio.run(replay(server.base_url, model, [
                dataclasses.replace(r, prefix_group=f"warmup-{shape_name}-{r.prefix_group}") for r in warm]))
        for k, rate in enumerate(rates):
            trace = llmd(rate, args.duration, args.seed + k, shape)
            trace = [dataclasses.replace(r, prefix_group=f"{shape_name}-{rate}-{r.prefix_group}") for r in trace]
            real = asyncio.run(replay(server.base_url, model, trace))
            spec = FleetSpec(**nodes, threads=threads if threads in profile.steps else None, kv_blocks=blocks)
            sim = simulate(trace, spec, profile, args.seed).to_json()
            point = {"shape": shape_name, "rate": rate, "requests": len(trace), "threads_per_node": threads,
                     "kv_blocks": blocks, "real": real, "sim": {m: sim[m] for m in METRICS}}
            points.append(point)
            print(json.dumps(point), flush=True)
    return points


def run(args: argparse.Namespace) -> int:
    from kvrelay.bench.report import emit
    from kvrelay.sim.calibrate import machine_info

    profile = load_profile(args.profile)
    rates = [float(r) for r in args.rates.split(",")]
    points: list[dict] = []
    info = machine_info()
    log_dir, done = Path(tempfile.mkdtemp(prefix="kvrelay-validate-")), False  # kept only if a fleet fails
    try:
        for shape_name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            points += _validate_shape(args, profile, shape_name, rates, log_dir)
        done = True
    finally:
        if done:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            logger.error("the fleets' logs: %s", log_dir)
    report = {"benchmark": "sim_validate", "machine": info, "profile": profile.name,
              "profile_fit": profile.fit, "load_average_at_end": list(os.getloadavg()), "points": points,
              "mape": mape(points),
              "trace": {"tenants": args.tenants, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                        "output_len": args.output_len, "duration_s": args.duration, "warmup_s": args.warmup}}
    emit(report, args.output)
    return 0


def markdown(report: dict) -> str:
    """The validation table, as docs/fleet.md shows it: real / simulated per point, then the error per metric."""
    head = ["| fleet | rate (req/s) | requests | " + " | ".join(f"{m} real / sim" for m in METRICS) + " |",
            "|" + " --- |" * (3 + len(METRICS))]
    rows = []
    for p in report["points"]:
        cells = [f"{p['real'][m]:.4g} / {p['sim'][m]:.4g}" for m in METRICS]
        rows.append(f"| {p['shape']} | {p['rate']:g} | {p['requests']} | " + " | ".join(cells) + " |")
    errors = "| MAPE | | | " + " | ".join(f"{100 * report['mape'][m]:.1f}%" for m in METRICS) + " |"
    return "\n".join([*head, *rows, errors])
