"""What serving adds to the engine's steps, measured on a real `kvrelay up` fleet: the last part of
`kvrelay sim calibrate`.

The calibration's grid times the engine alone, in its process. A served fleet also streams each step's tokens
through the node's RPCs, the gateway and the client; on a machine whose cores the engines use, that CPU comes out
of their steps. A request also crosses the gateway (HTTP, routing, its RPCs, waking an idle node) before the
engine sees it. Both are measured as differences against the simulator itself on the same requests, in a fleet
of the placement that gives each node the thread count (colocated on every core; 1 prefill + 1 decode where each
gets half):

- lone streams, the fleet idle before each: time to first token and the gaps between tokens;
- ROWS streams at once: the gaps between tokens.

`served_step_s + served_row_s * rows` is solved from the gaps' differences (real less simulated, medians) at 1
and ROWS rows, neither below 0 (both came out below 0 in some calibrations here, and a simulator that used them
was as far below the real gaps as it had been above: a difference of two medians of a few hundred gaps is that
noisy on this VM); `request_overhead_s` is then the lone requests' time to first token less the simulated one with
those step terms. None of it is fitted to a validation trace (kvrelay.sim.validate).
"""

from __future__ import annotations

import asyncio
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvrelay.sim.fleet import FleetSpec
from kvrelay.sim.run import simulate
from kvrelay.sim.timemodel import SERVED_ROWS, LinearStep, Profile
from kvrelay.sim.trace import TraceRequest

LONE, LONE_WARMUP, ROUNDS = 26, 2, 4  # lone requests (the first ones not counted); rounds of ROWS streams at once
ROWS = SERVED_ROWS
OUTPUT, PROMPT = 24, 48  # tokens per stream: out, and the prompt (short: a decode node prefills it itself)


@dataclass(frozen=True)
class Served:
    served_step_s: float
    served_row_s: float
    request_overhead_s: float

    def applied(self, step: LinearStep) -> LinearStep:
        return replace(step, **{k: round(v, 6) for k, v in vars(self).items()})


def served_fleet(threads: int, cores: int) -> tuple[list[str], dict] | None:
    """The `kvrelay up` flags and FleetSpec counts whose nodes get `threads` CPU threads each here, if any."""
    if threads == cores:
        return ["--colocated"], {"colocated": 1}
    if 2 * threads == cores:
        return ["--prefill", "1", "--decode", "1"], {"prefill": 1, "decode": 1}
    return None


@dataclass
class _Replies:
    lone_ttft: list[float]
    lone_gaps: list[float]
    batch_gaps: list[float]


async def _drive(base_url: str, lone: list[list[int]], batches: list[list[list[int]]]) -> _Replies:
    from kvrelay.bench.client import Client

    async with Client(base_url) as client:
        model = (await client.models())[0]

        async def one(prompt: list[int]):
            reply = await client.post("completions", {
                "model": model, "prompt": prompt, "max_tokens": OUTPUT, "min_tokens": OUTPUT, "ignore_eos": True,
                "temperature": 0.0, "stream": True})
            if not reply.ok or reply.ttft_s is None:
                raise RuntimeError(f"calibrate: a request to the served fleet failed: {reply.error or reply.status}")
            return reply

        out = _Replies([], [], [])
        for i, prompt in enumerate(lone):
            reply = await one(prompt)
            if i >= LONE_WARMUP:
                out.lone_ttft.append(reply.ttft_s)
                out.lone_gaps += reply.itl_s
            await asyncio.sleep(0.3)  # the fleet idles between them, as before a lone arrival
        for batch in batches:
            for reply in await asyncio.gather(*(one(p) for p in batch)):
                out.batch_gaps += reply.itl_s
            await asyncio.sleep(0.3)
    return out


def _simulated(prompts: list[list[int]], spec: FleetSpec, profile: Profile) -> tuple[float, float]:
    """Time to first token and the median gap of these requests arriving together, simulated."""
    r = simulate([TraceRequest(arrival_s=0.0, output_len=OUTPUT, prompt_tokens=tuple(p)) for p in prompts], spec,
                 profile)
    return r.ttft_p50_s, r.itl_p50_s


def measure_served(profile: Profile, threads: int, log_dir: Path, up_flags: list[str]) -> Served | None:
    """Serve `profile`'s model (`kvrelay up` with `up_flags`) with `threads` threads per node, and measure what
    serving adds to its fitted steps. None: no placement gives each node that many threads here."""
    from kvrelay.bench.fleet import Server

    placement = served_fleet(threads, len(os.sched_getaffinity(0)))
    if placement is None:
        return None
    flags, nodes = placement
    rng = np.random.default_rng(threads)
    high = min(profile.model.vocab_size, 40000)
    lone = [rng.integers(10, high, size=PROMPT).tolist() for _ in range(LONE)]
    batches = [[rng.integers(10, high, size=PROMPT).tolist() for _ in range(ROWS)] for _ in range(ROUNDS)]
    with Server.up([*flags, *up_flags], log_dir=log_dir, name=f"calibrate-{threads}") as server:
        real = asyncio.run(_drive(server.base_url, lone, batches))

    spec = FleetSpec(**nodes, threads=threads)
    engine = profile.steps[threads].engine_only()

    def sim(step: LinearStep, prompts: list[list[int]]) -> tuple[float, float]:
        return _simulated(prompts, spec, replace(profile, steps={threads: step}))

    # Simulated time depends on the requests' shapes, not their tokens: one lone request, one batch stand for all.
    d1 = statistics.median(real.lone_gaps) - sim(engine, lone[:1])[1]
    d_rows = statistics.median(real.batch_gaps) - sim(engine, batches[0])[1]
    row = max(0.0, (d_rows - d1) / (ROWS - 1))
    step = max(0.0, d1 - row)
    ttft = sim(replace(engine, served_step_s=step, served_row_s=row), lone[:1])[0]
    return Served(step, row, max(0.0, statistics.median(real.lone_ttft) - ttft))
