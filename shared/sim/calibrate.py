"""`kvrelay sim calibrate`: measure this machine's engine over a grid of step shapes and fit the step-time model
of the `local` profile (kvrelay.sim.timemodel), with the machine it came from.

For each CPU thread count (default: every core, and one: what a colocated node and what each node of a
1 prefill + 1 decode fleet get on this machine) the real engine (EngineCore, the default model, its default
dtype) runs steps of known shapes: prefill chunks of n tokens after a cached context of c tokens, decode steps
of r rows at context c, and a mixed step. Each step is timed as a node runs it (schedule, forward pass and
sampling, update) and its shape is read from the scheduler's output as the simulator reads it. A least-squares
fit with non-negative coefficients gives the linear step model, at the GEMM tile height that fits best; its
error on the measured steps is recorded.
The same-host KV transfer is measured with `kvrelay bench kv-transfer` (shm) at two sizes: bandwidth and
per-transfer overhead. Start-up is the engine's build time (model load and warm-up; process start excluded).
Last, what serving adds to each thread count's steps and requests, on a real `kvrelay up` fleet
(kvrelay.sim.calibrate_served).

    kvrelay sim calibrate                      # writes the local profile (kvrelay sim run --profile local)
    kvrelay sim calibrate --quick --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvrelay.common.units import byte_size
from kvrelay.sim.calibrate_served import measure_served
from kvrelay.sim.timemodel import (
    LINEAR_TERMS,
    LinearStep,
    ModelShape,
    Profile,
    StepShape,
    TransferModel,
    linear_features,
    local_profile_path,
    step_shape,
)

HELP = "measure this machine's engine and fit the local step-time profile"

# (kind, tokens per chunk or rows, context): a grid small enough for a few minutes on 2 cores.
GRID = [("prefill", n, c) for n in (16, 64, 256, 1024) for c in (0, 1024)] + \
       [("decode", r, c) for r in (1, 8, 32) for c in (256, 1536)] + [("decode", r, 256) for r in (2, 4, 6, 12, 16)] + \
       [("mixed", 8, 512)]
TILE_ROWS = (0, 4, 6, 8, 16)  # the GEMM tile heights calibration tries (0: no pass term); it keeps the best fit
QUICK_GRID = [("prefill", 32, 0), ("prefill", 64, 64), ("decode", 1, 64), ("decode", 8, 128), ("mixed", 4, 64)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help=f"profile JSON to write (default: {local_profile_path()})")
    p.add_argument("--model", default="default", help="the model the fleet serves")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", type=byte_size, default=None,
                   help="KV cache per node, as `kvrelay up` gives it (default: the engine's, 2 GiB on CPU)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: all cores, and 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per shape (after a warm-up)")
    p.add_argument("--quick", action="store_true", help="a five-shape grid (a smoke run)")
    p.add_argument("--skip-transfer", action="store_true", help="keep the default same-host transfer figures")
    p.add_argument("--skip-served", action="store_true",
                   help="no real fleet: the profile models the engine's steps alone")


@dataclass(frozen=True)
class Point:
    threads: int
    kind: str
    shape: StepShape
    seconds: float


class Bench:
    """The engine, stepped by hand so that each timed step has the shape asked for."""

    def __init__(self, core, salt: int = 0) -> None:
        self.core = core
        self.seq = 0
        self.salt = salt  # a pass per thread count: its prompts must not hit the previous pass's prefix cache

    def _prompt(self, seed: int, n: int) -> list[int]:
        high = min(self.core.vocab_size, 40000)
        return np.random.default_rng([self.salt, seed]).integers(min(10, high - 1), high, size=n).tolist()

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        from kvrelay.common.sampling_params import SamplingParams

        self.seq += 1
        rid = f"cal-{self.seq}"
        self.core.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def step(self) -> tuple[StepShape, float]:
        sched_ = self.core.scheduler
        t0 = time.perf_counter()
        sched = sched_.schedule()
        shape = step_shape(sched, sched_.requests)
        result = self.core.runner.execute(sched)
        sched_.update_from_output(sched, result)
        return shape, time.perf_counter() - t0

    def drain(self) -> None:
        while self.core.has_unfinished():
            self.step()

    def prefill(self, n: int, ctx: int, repeats: int) -> list[tuple[StepShape, float]]:
        base = self._prompt(ctx, ctx)
        if ctx:
            self._add(base + self._prompt(1, 16), 1)  # leaves the context's blocks in the prefix cache
            self.drain()
        out = []
        for i in range(repeats + 1):
            self._add(base + self._prompt(10_000 + 97 * i + n, n), 1)
            out.append(self.step())
            self.drain()
        return out[1:]

    def decode(self, rows: int, ctx: int, repeats: int, chunk: int = 0) -> list[tuple[StepShape, float]]:
        # Rows that prefilled first decode while the others prefill: they must not finish before all are in.
        budget = self.core.max_model_len - ctx - 1
        rids = [self._add(self._prompt(50_000 + 131 * r + ctx, ctx), budget) for r in range(rows)]
        while any(req.num_computed_tokens < req.num_prompt_tokens for req in self.core.scheduler.requests.values()):
            self.step()
        out = []
        for i in range(repeats + 1):
            if chunk:
                self._add(self._prompt(70_000 + i, chunk), 1)
            out.append(self.step())
        self.core.abort(rids)
        self.drain()
        return out[1:]


def fits(core, kind: str, a: int, ctx: int, repeats: int) -> bool:
    """Whether the engine can hold the shape: the model's context, and the KV cache for every row at once."""
    longest = ctx + (a if kind == "prefill" else repeats + 3) + 16
    rows = 2 if kind == "prefill" else a + (1 if kind == "mixed" else 0)
    blocks = rows * -(-longest // core.config.cache.block_size)
    return longest < core.max_model_len and blocks <= core.num_blocks


def measure(core, threads: int, grid, repeats: int) -> list[Point]:
    """The median step time of each shape of the grid the engine can hold (the others are skipped)."""
    import torch

    torch.set_num_threads(threads)
    bench = Bench(core, salt=threads)
    bench.prefill(16, 0, 1)  # warm-up at this thread count
    points = []
    for kind, a, ctx in grid:
        if not fits(core, kind, a, ctx, repeats):
            continue
        if kind == "prefill":
            steps = bench.prefill(a, ctx, repeats)
        else:  # a mixed step: the decode rows and one prompt of ctx / 2 tokens
            steps = bench.decode(a, ctx, repeats, chunk=ctx // 2 if kind == "mixed" else 0)
        shape = steps[0][0]
        points.append(Point(threads, kind, shape, statistics.median(s for _, s in steps)))
    return points


def fit_best(points: list[Point]) -> tuple[LinearStep, dict]:
    """fit_linear at each of TILE_ROWS: the one with the smallest error."""
    return min((fit_linear(points, rows) for rows in TILE_ROWS), key=lambda fit: fit[1]["mape"])


def fit_linear(points: list[Point], tile_rows: int = 0) -> tuple[LinearStep, dict]:
    """Least squares with every coefficient >= 0 (a negative cost per token would mean nothing): terms that come
    out negative are dropped and the rest refitted. `tile_rows`: the GEMM's tile height (timemodel), 0: none."""
    x = np.array([linear_features(p.shape, tile_rows) for p in points], dtype=np.float64)
    y = np.array([p.seconds for p in points], dtype=np.float64)
    w = 1.0 / y  # relative error: small steps matter as much as big ones
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep = [k for k, c in zip(keep, coef) if c >= 0]
    full = np.zeros(x.shape[1])
    full[keep] = np.clip(coef, 0, None)
    terms = {k: float(c) for k, c in zip(LINEAR_TERMS, full)}
    model = LinearStep(**terms, tile_rows=tile_rows if terms["per_tile_pass_s"] else 0)
    errors = [abs(model.time(p.shape) - p.seconds) / p.seconds for p in points]
    return model, {"points": len(points), "mape": round(float(np.mean(errors)), 4),
                   "max_error": round(float(np.max(errors)), 4), "tile_rows": model.tile_rows}


def measure_transfer(tmp: Path) -> TransferModel:
    """Same-host (shm) transfer at two sizes, through `kvrelay bench kv-transfer`: bandwidth and overhead."""
    from kvrelay.bench import kv_transfer

    times = {}
    for blocks in (16, 160):
        out = tmp / f"kv-{blocks}.json"
        p = argparse.ArgumentParser()
        kv_transfer.add_arguments(p)
        args = p.parse_args(["--connectors", "shm", "--blocks", str(blocks), "--pattern", "scattered",
                             "--repeats", "3", "--output", str(out)])
        kv_transfer.run(args)
        report = json.loads(out.read_text())
        row = report["results"][0]
        times[report["bytes_per_transfer"]] = statistics.median(row["seconds"])
    (b1, t1), (b2, t2) = sorted(times.items())
    bw = (b2 - b1) / max(t2 - t1, 1e-9)
    return TransferModel(same_host_bytes_per_s=bw, network_bytes_per_s=bw, per_request_s=max(0.0, t1 - b1 / bw))


def machine_info() -> dict:
    import platform

    from kvrelay.bench.report import machine
    from kvrelay.engine.auto_dtype import cpu_flags, cpu_model

    flags = cpu_flags()
    load = os.getloadavg()
    return {**machine(), "cpu_model": cpu_model(), "kernel": platform.release(),
            "simd": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")),
            "load_average_1m_at_start": round(load[0], 2)}


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.engine import kernels
    from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig
    from kvrelay.engine.core import EngineCore
    from kvrelay.engine.model_info import read_model_shape

    cores = len(os.sched_getaffinity(0))
    threads = sorted({int(t) for t in args.threads.split(",")} if args.threads else {cores, 1}, reverse=True)
    info = machine_info()
    kernels.load()  # built once per machine, not at each node start: not part of the start-up time
    t0 = time.perf_counter()
    torch.set_num_threads(max(threads))
    core = EngineCore(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                                   cache=CacheConfig(kv_cache_memory=args.kv_cache_memory)))
    startup_s = time.perf_counter() - t0
    grid = QUICK_GRID if args.quick else GRID
    steps, fits, points = {}, {}, []
    for t in threads:
        pts = measure(core, t, grid, args.repeats)
        model, fit = fit_best(pts)
        steps[t], fits[str(t)] = model, fit
        points += pts
        print(json.dumps({"threads": t, **fit, **{k: getattr(model, k) for k in LINEAR_TERMS}}), flush=True)
    transfer = TransferModel(same_host_bytes_per_s=2e9, network_bytes_per_s=2e9, per_request_s=0.002)
    measured = ["step times (linear fit per thread count)", "KV cache blocks", "engine start-up"]
    if not args.skip_transfer:
        with tempfile.TemporaryDirectory(prefix="kvrelay-calibrate-") as tmp:
            transfer = measure_transfer(Path(tmp))
        measured.append("same-host KV transfer (shm): bandwidth and per-transfer overhead")
    shape = read_model_shape(args.model)
    dtype = str(core.info.dtype).removeprefix("torch.")
    element = torch.tensor([], dtype=core.info.dtype).element_size()
    hf_params = sum(p.numel() for p in core.runner.model.parameters()) if hasattr(core.runner, "model") else 0
    model = ModelShape(name=shape.model_id, num_layers=shape.num_layers, hidden_size=0, num_heads=0,
                       num_kv_heads=shape.num_kv_heads, head_size=shape.head_size, params=float(hf_params),
                       vocab_size=core.vocab_size, dtype_bytes=element)
    profile = Profile(
        name="local", source="calibrated",
        description=f"{info['cpu_model']}, {cores} cores: the default engine ({shape.model_id}, {dtype}) measured",
        model=model, kv_cache_blocks=core.num_blocks, block_size=core.config.cache.block_size,
        startup_s=round(startup_s, 3), transfer=transfer, steps=steps, single_host=True,
        machine={**info, "dtype": dtype, "grid": [list(g) for g in grid], "repeats": args.repeats,
                 "points": [{"threads": p.threads, "kind": p.kind, "shape": p.shape._asdict(), "seconds": p.seconds}
                            for p in points]},
        figures={"measured": measured, "modelled": [] if not args.skip_transfer else ["same-host KV transfer"]},
        fit=fits,
    )
    core.shutdown()  # the served fleets below bring their own engines
    if not args.skip_served:
        up_flags = ["--model", args.model, "--dtype", args.dtype]
        if args.kv_cache_memory:
            up_flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
        served_steps = dict(steps)
        with tempfile.TemporaryDirectory(prefix="kvrelay-calibrate-") as tmp:
            for t in threads:
                served = measure_served(profile, t, Path(tmp), up_flags)
                if served is not None:
                    served_steps[t] = served.applied(steps[t])
                    print(json.dumps({"threads": t, **vars(served)}), flush=True)
        profile = replace(profile, steps=served_steps, figures={**profile.figures, "measured": [
            *measured, "what serving adds per step, per row and per request: streams on a served fleet, less the "
                       "simulated ones"]})
    path = profile.save(args.out or local_profile_path())
    print(json.dumps({"profile": str(path), "startup_s": profile.startup_s, "kv_cache_blocks": profile.kv_cache_blocks,
                      "transfer": vars(transfer), "fit": fits}))
    return 0
