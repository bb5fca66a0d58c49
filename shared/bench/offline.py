"""The one way benchmarks drive an engine in their own process (throughput, spec-decode, structured): requests
kept in flight in a closed loop, each output token's arrival timed."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.bench.stats import percentiles


@dataclass
class Timing:
    """One request as the engine ran it (time.perf_counter() readings)."""

    start: float
    first: float | None = None
    last: float = 0.0
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token once decoding started: (last - first) / (tokens - 1)."""
        return (self.last - self.first) / (len(self.tokens) - 1) if self.first is not None and len(self.tokens) > 1 \
            else None


def run_closed_loop(engine, requests: Sequence[tuple[Sequence[int], object]], batch: int | None = None,
                    bar=None, loras: Sequence[str] | None = None) -> tuple[float, list[Timing]]:
    """Keep `batch` of the (prompt token ids, SamplingParams) requests in flight (None: all at once), in order,
    stepping the engine until every one finished; (elapsed seconds, each request's timing). `bar` (tqdm) counts
    finished requests; `loras`: each request's LoRA adapter ("": the base model)."""
    queue, timings, live = deque(enumerate(requests)), {}, 0
    t0 = time.perf_counter()
    while queue or live:
        while queue and (batch is None or live < batch):
            i, (prompt, params) = queue.popleft()
            timings[i] = Timing(time.perf_counter())
            engine.add_request(str(i), list(prompt), params, lora_name=loras[i] if loras else "")
            live += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            t = timings[int(out.req_id)]
            if out.new_token_ids:
                t.first = now if t.first is None else t.first
                t.last = now
                t.tokens.extend(out.new_token_ids)
            t.cached_tokens = max(t.cached_tokens, out.num_cached_tokens)
            if out.finish_reason is not None:
                live -= 1
                if bar is not None:
                    bar.update(1)
    return time.perf_counter() - t0, [timings[i] for i in range(len(requests))]


def summarize_timings(elapsed: float, timings: list[Timing]) -> dict:
    """Output tokens/s, ITL (mean, p50, p90 in ms) and mean TTFT of a closed-loop run's requests."""
    itls = [t.tpot_s for t in timings if t.tpot_s is not None]
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    output = sum(len(t.tokens) for t in timings)
    p = percentiles(itls, 1000, (50, 90))
    return {"requests": len(timings), "output_tokens": output, "elapsed_s": elapsed,
            "output_tokens_per_s": output / elapsed, "itl_ms_mean": 1000 * statistics.fmean(itls) if itls else None,
            "itl_ms_p50": p["p50"], "itl_ms_p90": p["p90"],
            "ttft_ms_mean": 1000 * statistics.fmean(ttfts) if ttfts else None}
