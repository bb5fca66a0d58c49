"""`kvrelay plan`: size a fleet for SLOs in the simulator, and check an autoscaler through the trace.

1. Search: shapes (colocated, or P prefill + D decode nodes) and engine budgets (`--batched-tokens`: the chunk a
   prompt is computed in and the step's token budget). For each, the fewest nodes that meet both SLOs (TTFT p90,
   ITL p90, nothing failed) on the trace's busiest window (`--window` seconds: a fleet that holds the peak holds
   the rest). Prints the cheapest as JSON and a Pareto table (nodes against p90 TTFT) to stderr.
2. `--autoscale`: the trace in full (or `--autoscale-trace`, another day) through the autoscalers deploy/k8s
   would run (kvrelay.sim.autoscale), nodes starting after the profile's start-up time: a schedule learned from
   the trace (kvrelay.sim.policy), over per-pod targets derived from the profile and the SLOs: queued prefill
   tokens per pod = prefill tokens/s x half the TTFT SLO (the queue-time signal), running requests per decode
   pod = the batch at which a step reaches the ITL SLO. Reports node-hours against the static fleet sized for
   the peak, the share of requests within both SLOs, and scale oscillations (up-down-up within 3 intervals),
   and the same without the queue-time signal and for a reactive-only HPA.
3. `--out DIR`: a kustomize overlay of deploy/k8s (on overlays/gpu for GPU profiles, overlays/cpu for a CPU one)
   with those bounds, targets and behaviour (a KEDA ScaledObject per pool: the schedule as cron triggers, the
   targets as Prometheus triggers), and the engine budget, as KVRELAY_* environment variables.

    kvrelay sim trace day --out day.jsonl
    kvrelay plan --trace day.jsonl --slo-ttft-p90 2 --slo-itl-p90 0.05 --profile h100 --autoscale \\
        --out deploy/k8s/overlays/planned
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass

from kvrelay.sim.autoscale import Autoscaler, HPAPolicy, oscillations
from kvrelay.sim.fleet import FleetSpec
from kvrelay.sim.overlay import write_overlay
from kvrelay.sim.policy import SLO, hpa_policy
from kvrelay.sim.results import Collector, RunResult
from kvrelay.sim.run import simulate
from kvrelay.sim.timemodel import Profile, load_profile
from kvrelay.sim.trace import TraceRequest, read_trace
from kvrelay.sim.workloads import Shape, llmd

HELP = "size P and D (or colocated nodes) for TTFT/ITL SLOs in the simulator; writes a kustomize overlay"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="JSONL trace (or give --rate, --isl, --osl)")
    p.add_argument("--rate", type=float, default=None, help="without --trace: requests per second (Poisson)")
    p.add_argument("--isl", type=int, default=2000, help="without --trace: prompt tokens (mean)")
    p.add_argument("--osl", type=int, default=200, help="without --trace: output tokens (mean)")
    p.add_argument("--duration", type=float, default=300.0, help="without --trace: seconds of arrivals")
    p.add_argument("--slo-ttft-p90", type=float, required=True, help="seconds")
    p.add_argument("--slo-itl-p90", type=float, required=True, help="seconds")
    p.add_argument("--profile", default="h100")
    p.add_argument("--modes", default="colocated,disaggregated")
    p.add_argument("--batched-tokens", default="2048,8192", help="engine token budgets to try")
    p.add_argument("--max-nodes", type=int, default=128)
    p.add_argument("--window", type=float, default=300.0, help="seconds of the busiest window searched (0: all)")
    p.add_argument("--autoscale", action="store_true",
                   help="simulate the autoscalers (schedule and metrics) through the whole trace")
    p.add_argument("--autoscale-trace", default=None,
                   help="with --autoscale: run them through this trace instead (another day: the schedule is "
                        "learned from --trace, so a held-out day shows it did not learn that day's bursts)")
    p.add_argument("--namespace", default="default", help="the fleet's namespace, for the overlay's queries")
    p.add_argument("--prometheus-url", default="http://prometheus-server.monitoring.svc:80",
                   help="where KEDA's Prometheus triggers query (the overlay)")
    p.add_argument("--out", default=None, help="write a kustomize overlay here")
    p.add_argument("--plots", default=None, help="write the frontier and the autoscaled day (PNG) here")
    p.add_argument("--seed", type=int, default=0)


@dataclass
class Candidate:
    spec: FleetSpec
    result: RunResult

    @property
    def nodes(self) -> int:
        return self.spec.prefill + self.spec.decode + self.spec.colocated

    def row(self, slo: SLO) -> dict:
        r = self.result
        return {"prefill": self.spec.prefill, "decode": self.spec.decode, "colocated": self.spec.colocated,
                "max_num_batched_tokens": self.spec.scheduler.max_num_batched_tokens, "nodes": self.nodes,
                "ttft_p50_s": r.ttft_p50_s, "ttft_p90_s": r.ttft_p90_s, "itl_p90_s": r.itl_p90_s,
                "output_tok_s": r.output_tok_s, "failed": r.failed, "meets_slo": slo.met(r)}


def busiest_window(trace: list[TraceRequest], window_s: float) -> list[TraceRequest]:
    """The requests of the `window_s` seconds with the most arrivals, shifted to start at 0."""
    if window_s <= 0 or not trace or trace[-1].arrival_s <= window_s:
        return trace
    times = [r.arrival_s for r in trace]
    best, start, j = 0, 0, 0
    for i in range(len(times)):
        while times[i] - times[j] > window_s:
            j += 1
        if i - j + 1 > best:
            best, start = i - j + 1, j
    t0 = times[start]
    return [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in trace[start:start + best]]


class Search:
    def __init__(self, trace: list[TraceRequest], profile: Profile, slo: SLO, seed: int, max_nodes: int) -> None:
        self.trace, self.profile, self.slo, self.seed, self.max_nodes = trace, profile, slo, seed, max_nodes
        self.tried: dict[FleetSpec, Candidate] = {}

    def evaluate(self, spec: FleetSpec) -> Candidate:
        if spec not in self.tried:
            self.tried[spec] = Candidate(spec, simulate(self.trace, spec, self.profile, self.seed))
            print(json.dumps({"tried": self.tried[spec].row(self.slo)}), file=sys.stderr, flush=True)
        return self.tried[spec]

    def smallest(self, make, lo: int = 1, hi: int | None = None) -> Candidate | None:
        """The smallest n >= lo whose spec meets the SLOs (doubling, then bisection; assumes more nodes help).
        None when none does, or when doubling n no longer helps (the bottleneck is elsewhere: the other pool)."""
        n, ok, last = lo, None, None
        top = self.max_nodes if hi is None else min(hi, self.max_nodes)
        while n <= top:
            c = self.evaluate(make(n))
            if self.slo.met(c.result):
                ok = c
                break
            if last is not None and not _better(c.result, last.result):
                return None
            last = c
            lo, n = n + 1, n * 2
        if ok is None:
            return None
        hi = n
        while lo < hi:
            mid = (lo + hi) // 2
            c = self.evaluate(make(mid))
            if self.slo.met(c.result):
                ok, hi = c, mid
            else:
                lo = mid + 1
        return ok

    def colocated(self, sched) -> Candidate | None:
        return self.smallest(lambda k: FleetSpec(colocated=k, scheduler=sched))

    def disaggregated(self, sched, bound: int | None = None) -> Candidate | None:
        """The fewest P + D nodes; `bound`: a shape of that many nodes is known already (larger ones are not tried)."""
        best: Candidate | None = None
        worse = 0
        for p in range(1, self.max_nodes):
            limit = min(x for x in (bound, best.nodes if best else None, self.max_nodes) if x is not None)
            if p + 1 > limit:
                break
            c = self.smallest(lambda d, p=p: FleetSpec(prefill=p, decode=d, scheduler=sched), hi=limit - p)
            if c is not None and (best is None or c.nodes < best.nodes):
                best, worse = c, 0
            else:
                worse += 1
                if worse >= 2:
                    break
        return best


def _better(r: RunResult, than: RunResult) -> bool:
    """Clearly better: fewer failures, or a p90 TTFT at least 10% lower."""
    if r.failed < 0.9 * than.failed:
        return True
    return r.ttft_p90_s is not None and (than.ttft_p90_s is None or r.ttft_p90_s < 0.9 * than.ttft_p90_s)


def pareto(candidates: list[Candidate]) -> list[Candidate]:
    """Shapes no cheaper shape beats on p90 TTFT (those that completed everything)."""
    out: list[Candidate] = []
    for c in sorted((c for c in candidates if c.result.failed == 0 and c.result.ttft_p90_s is not None),
                    key=lambda c: (c.nodes, c.result.ttft_p90_s)):
        if not out or c.result.ttft_p90_s < out[-1].result.ttft_p90_s:
            out.append(c)
    return out


# -- autoscaling ------------------------------------------------------------------------------------------


def autoscaled_run(trace: list[TraceRequest], choice: Candidate, profile: Profile, slo: SLO, seed: int,
                   policy: HPAPolicy, start_fraction: float = 0.25) -> dict:
    """The trace through the autoscaled fleet. It starts at its schedule's size for time 0, or without a
    schedule at `start_fraction` of the static pools."""
    spec = choice.spec
    begin = {"prefill": 0, "decode": 0, "colocated": 0}
    for role, n in (("prefill", spec.prefill), ("decode", spec.decode), ("colocated", spec.colocated)):
        pool = policy.pools.get(role)
        if n and pool is not None:
            begin[role] = pool.schedule.replicas_at(0.0) if pool.schedule else max(1, math.ceil(n * start_fraction))
    scaler = Autoscaler(policy)
    collector = Collector()
    fleets = []

    def setup(fleet) -> None:
        scaler.install(fleet)
        fleets.append(fleet)

    result = simulate(trace, dataclasses.replace(spec, **begin), profile, seed, setup=setup, collector=collector)
    return {"result": result, "changes": scaler.changes, "collector": collector, "timeline": fleets[0].timeline.nodes,
            "within_slo": collector.within(slo.ttft_p90_s, slo.itl_p90_s, len(trace)),
            "oscillations": oscillations(scaler.changes, policy.sync_s)}


def autoscale_report(trace: list[TraceRequest], day: list[TraceRequest], applied: HPAPolicy, best: Candidate,
                     profile: Profile, slo: SLO, seed: int) -> tuple[dict, dict]:
    """`day` through the static fleet and three autoscalers planned on `trace` (the same day, or yesterday's):
    `applied` (the schedule with the reactive metrics: what the overlay applies), the same without the
    queue-time signal, and a reactive-only HPA that holds the burst headroom itself. Returns the report and the
    first run."""
    static = simulate(day, best.spec, profile, seed, collector=(static_c := Collector()))
    report = {"static_node_hours": static.config["node_hours"],
              "static_within_slo": round(static_c.within(slo.ttft_p90_s, slo.itl_p90_s, len(day)), 5)}
    first = None
    for key, policy in (("applied", applied),
                        ("without_queue_signal", dataclasses.replace(applied, use_queue_signal=False)),
                        ("reactive_only", hpa_policy(best.spec, profile, slo, trace))):
        run_ = autoscaled_run(day, best, profile, slo, seed, policy)
        r = run_["result"]
        figures = {"node_hours": r.config["node_hours"],
                   "ratio_to_static": round(r.config["node_hours"] / static.config["node_hours"], 4),
                   "within_slo": round(run_["within_slo"], 5), "oscillations": run_["oscillations"],
                   "scale_events": len(run_["changes"]), "ttft_p90_s": r.ttft_p90_s, "itl_p90_s": r.itl_p90_s,
                   "failed": r.failed}
        print(json.dumps({"autoscaled": key, **figures}), file=sys.stderr, flush=True)
        if first is None:  # what the overlay applies: at the top level
            report.update(figures)
            first = run_
        else:
            report[key] = figures
    return report, first


def _trace(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace:
        return read_trace(args.trace)
    if args.rate is None:
        raise ValueError("give --trace, or --rate (with --isl, --osl)")
    shape = Shape(tenants=1_000_000, prefix_len=0, suffix_len=args.isl, output_len=args.osl, spread=0.5)
    return llmd(args.rate, args.duration, args.seed, shape)


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    slo = SLO(args.slo_ttft_p90, args.slo_itl_p90)
    trace = _trace(args)
    window = busiest_window(trace, args.window)
    search = Search(window, profile, slo, args.seed, args.max_nodes)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    found: list[Candidate] = []
    for budget in (int(b) for b in args.batched_tokens.split(",")):
        sched = dataclasses.replace(FleetSpec(decode=1).scheduler, max_num_batched_tokens=budget)
        for mode in modes:
            bound = min((c.nodes for c in found), default=None)
            c = search.colocated(sched) if mode == "colocated" else search.disaggregated(sched, bound)
            if c is not None:
                found.append(c)
    if not found:
        print(json.dumps({"error": f"no shape of at most {args.max_nodes} nodes meets the SLOs"}))
        return 1
    best = min(found, key=lambda c: (c.nodes, c.result.ttft_p90_s))
    span_h = (trace[-1].arrival_s if trace else 0.0) / 3600
    out = {**{k: v for k, v in best.row(slo).items() if k != "meets_slo"},
           "node_hours": round(best.nodes * span_h, 4), "searched_window_s": args.window,
           "pareto": [c.row(slo) for c in pareto(list(search.tried.values()))], "profile": profile.name}
    policy = hpa_policy(best.spec, profile, slo, trace, scheduled=True, window=window)
    out["schedule"] = {role: {"period_s": pool.schedule.period_s, "steps": [list(s) for s in pool.schedule.steps]}
                       for role, pool in policy.pools.items() if pool.schedule is not None}
    auto = None
    if args.autoscale:
        day = read_trace(args.autoscale_trace) if args.autoscale_trace else trace
        out["autoscale"], auto = autoscale_report(trace, day, policy, best, profile, slo, args.seed)
        out["autoscale"]["trace"] = args.autoscale_trace or args.trace
    if args.plots:
        from pathlib import Path

        from kvrelay.sim.plots import autoscaled_day, frontier

        plots = Path(args.plots)
        plots.mkdir(parents=True, exist_ok=True)
        out["plots"] = [str(frontier([c.row(slo) for c in search.tried.values()], plots / "plan_frontier.png",
                                     slo.ttft_p90_s))]
        if auto is not None:
            out["plots"].append(str(autoscaled_day(auto["timeline"], [r.arrival_s for r in day],
                                                   plots / "plan_autoscaled_day.png")))
    if args.out:
        out["overlay"] = [str(p) for p in write_overlay(args.out, best, policy, profile, namespace=args.namespace,
                                                        prometheus_url=args.prometheus_url)]
    print(format_table(out["pareto"]), file=sys.stderr)
    print(json.dumps(out))
    return 0


def format_table(rows: list[dict]) -> str:
    head = "nodes  P  D  colo  budget  ttft_p90_s  itl_p90_s  meets"
    lines = [head] + [f"{r['nodes']:5d} {r['prefill']:2d} {r['decode']:2d} {r['colocated']:5d} "
                      f"{r['max_num_batched_tokens']:7d} {r['ttft_p90_s']:11.3f} {r['itl_p90_s']:10.4f}  "
                      f"{'yes' if r['meets_slo'] else 'no'}" for r in rows]
    return "\n".join(lines)
