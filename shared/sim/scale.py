"""`kvrelay sim scale`: what routing is worth at 8 to 256 nodes, every policy on the same traces and seed.

Each trace starts with a warm-up (every tenant once, not counted), as a benchmark warms up.
1. sweep: the llm-d shape (150 tenants, 6,000-token shared prefixes, 1,200-token questions) on 8 colocated nodes
   over a QPS sweep; the highest QPS at which precise routing keeps p90 TTFT within 1 s, and the other policies'
   p90 TTFT there.
2. nodes: 8, 32, 64 and 256 nodes, the load and the tenants per node held constant: p50/p90/p99 TTFT,
   output tokens/s, prefix hit ratio against the ratio that was cached somewhere, load imbalance.
3. gateways: 1, 4 and 8 gateways sharing one index (precise) or each on its own (approximate), and a gateway
   restarted mid-run; at the sweep's highest QPS within 1 s.
4. hot prefix: one tenant sends most of the traffic; routing must spread it rather than pile onto the node that
   holds its prefix ("death spiral").
Writes <out>/scale.json and the plots docs/fleet.md shows.

    kvrelay sim scale --out docs/fleet                 # the whole study (long: run it once)
    kvrelay sim scale --out /tmp/s --quick             # a small version of each part
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvrelay.sim.fleet import FleetSpec
from kvrelay.sim.results import Collector
from kvrelay.sim.run import simulate
from kvrelay.sim.timemodel import load_profile
from kvrelay.sim.trace import TraceRequest
from kvrelay.sim.workloads import LLMD, Shape, llmd, with_warmup

HELP = "routing policies at 8-256 nodes, shared-index gateways, a gateway restart, a hot prefix"
POLICIES = ("precise", "approximate", "round_robin", "random", "least_load")


@dataclass(frozen=True)
class Plan:
    """How big each part is (the full study, or --quick)."""

    sweep_qps: tuple[float, ...] = (4, 6, 8, 9, 10, 11, 12)
    # A 1,000-token answer decodes for ~40 s, so a fleet's batches fill for the first minute: a 60 s run met 1 s
    # at 12 QPS that a 180 s run shows it cannot hold (docs/fleet.md).
    sweep_s: float = 180.0
    shape: Shape = LLMD
    node_counts: tuple[int, ...] = (8, 32, 64, 256)
    per_node_qps: float = 1.5
    nodes_s: float = 30.0
    nodes_per_gateway: int = 32  # a big fleet has several gateways (each admits at most 1,024 requests at once)
    nodes_shape: Shape = Shape(tenants=150, prefix_len=6000, suffix_len=1200, output_len=200)
    gateway_counts: tuple[int, ...] = (1, 4, 8)
    gateway_qps: float = 6.0
    hot_qps: float = 8.0
    hot_share: float = 0.6
    kv_blocks: int | None = None  # per node (None: the profile's)
    warmup_s: float = 30.0  # every tenant's prefix computed once, before what is measured

    def fleet(self, **kw) -> FleetSpec:
        return FleetSpec(kv_blocks=self.kv_blocks, **kw)


QUICK = Plan(sweep_qps=(2, 6), sweep_s=10.0, shape=Shape(tenants=20, prefix_len=1000, suffix_len=200, output_len=20),
             node_counts=(4, 8), per_node_qps=1.0, nodes_s=8.0, nodes_per_gateway=4,
             nodes_shape=Shape(tenants=20, prefix_len=1000, suffix_len=200, output_len=20), gateway_counts=(1, 4),
             gateway_qps=4.0, hot_qps=4.0, kv_blocks=2000, warmup_s=4.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="h100")
    p.add_argument("--out", default="docs/fleet", help="folder for scale.json and the plots")
    p.add_argument("--parts", default="sweep,nodes,gateways,hot")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-qps", default=None, help="sweep: comma-separated QPS (default: 4,6,8,9,10,11,12)")
    p.add_argument("--node-counts", default=None, help="nodes: comma-separated fleet sizes (default: 8,32,64,256)")
    p.add_argument("--nodes-seconds", type=float, default=None, help="nodes: seconds of arrivals (default: 30)")
    p.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                   help="simulate nothing: merge these runs' scale.json files (or their printed rows) into <out>")


def row(name: str, r, **extra) -> dict:
    d = r.to_json()
    return {"case": name, **extra, **{k: d[k] for k in (
        "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s", "output_tok_s", "prefix_hit_ratio",
        "would_hit_ratio", "load_imbalance", "completed", "failed", "wall_s")}}


def _log(item: dict) -> None:
    print(json.dumps(item), flush=True)


def warmed(trace: list[TraceRequest], shape: Shape, plan: Plan) -> tuple[list[TraceRequest], int]:
    """The trace after a warm-up that visits every tenant once (spread over `warmup_s`), as benchmarks warm up."""
    return with_warmup(trace, shape, plan.warmup_s / shape.tenants)


def sweep(plan: Plan, profile, seed: int, cdfs: dict) -> dict:
    rows = []
    for qps in plan.sweep_qps:
        trace, skip = warmed(llmd(qps, plan.sweep_s, seed, plan.shape), plan.shape, plan)
        for policy in POLICIES:
            c = Collector(skip)
            r = simulate(trace, plan.fleet(colocated=8, policy=policy), profile, seed, collector=c)
            rows.append(row("sweep", r, qps=qps, policy=policy, nodes=8))
            cdfs[(qps, policy)] = c.ttft
            _log(rows[-1])
    return sweep_summary(rows)


def sweep_summary(rows: list[dict]) -> dict:
    """The highest QPS at which precise routing keeps p90 TTFT within 1 s, and each policy's p90 there over it."""
    met = [x["qps"] for x in rows if x["policy"] == "precise" and x["failed"] == 0 and x["ttft_p90_s"] <= 1.0]
    out: dict = {"rows": rows}
    if met:
        q = max(met)
        at = {x["policy"]: x for x in rows if x["qps"] == q}
        p90 = at["precise"]["ttft_p90_s"]
        out["best_qps"] = q
        out["p90_ratio_to_precise"] = {p: round(at[p]["ttft_p90_s"] / p90, 2) for p in POLICIES if p in at}
    return out


def nodes(plan: Plan, profile, seed: int) -> dict:
    rows = []
    for n in plan.node_counts:
        shape = Shape(tenants=max(1, round(plan.nodes_shape.tenants * n / 8)), prefix_len=plan.nodes_shape.prefix_len,
                      suffix_len=plan.nodes_shape.suffix_len, output_len=plan.nodes_shape.output_len)
        trace, skip = warmed(llmd(plan.per_node_qps * n, plan.nodes_s, seed, shape), shape, plan)
        g = max(1, n // plan.nodes_per_gateway)
        for policy in POLICIES:
            r = simulate(trace, plan.fleet(colocated=n, policy=policy, gateways=g), profile, seed,
                         collector=Collector(skip))
            rows.append(row("nodes", r, nodes=n, policy=policy, qps=plan.per_node_qps * n, gateways=g,
                            tenants=shape.tenants))
            _log(rows[-1])
    return {"rows": rows}


def gateways(plan: Plan, profile, seed: int, qps: float) -> dict:
    rows = []
    trace, skip = warmed(llmd(qps, plan.sweep_s, seed, plan.shape), plan.shape, plan)
    restart_at = plan.warmup_s + plan.sweep_s / 2
    for policy in ("precise", "approximate"):
        for g in plan.gateway_counts:
            r = simulate(trace, plan.fleet(colocated=8, gateways=g, policy=policy), profile, seed,
                         collector=Collector(skip))
            rows.append(row("gateways", r, gateways=g, policy=policy, nodes=8, qps=qps))
            _log(rows[-1])
        g = max(plan.gateway_counts)
        r = simulate(trace, plan.fleet(colocated=8, gateways=g, policy=policy, restarts=((restart_at, 0),)),
                     profile, seed, collector=Collector(skip))
        rows.append(row("restart", r, gateways=g, policy=policy, nodes=8, qps=qps, restart_at_s=restart_at))
        _log(rows[-1])
    return gateway_summary(rows)


def gateway_summary(rows: list[dict]) -> dict:
    """How far apart the prefix hit ratios of 1 to N gateways sharing the index are (percentage points)."""
    hits = [x["prefix_hit_ratio"] for x in rows if x["case"] == "gateways" and x["policy"] == "precise"]
    return {"rows": rows, "precise_hit_ratio_spread_points": round(100 * (max(hits) - min(hits)), 2) if hits else None}


def merge(paths: list[str]) -> dict:
    """One report from the rows of several runs (their scale.json, or their printed rows: a study run as several
    processes, `--parts`, or stopped early). Later rows of the same case replace earlier ones."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        text = Path(path).read_text()
        try:
            data = json.loads(text)
            found = [r for part in ("sweep", "nodes", "gateways", "hot") for r in data.get(part, {}).get("rows", [])]
        except json.JSONDecodeError:
            found = [json.loads(line) for line in text.splitlines() if line.startswith('{"case"')]
        for r in found:
            key = tuple(r.get(k) for k in ("case", "qps", "policy", "nodes", "gateways", "restart_at_s"))
            rows[key] = r
    parts: dict = {"sweep": [], "nodes": [], "gateways": [], "hot": []}
    for r in rows.values():
        parts["gateways" if r["case"] == "restart" else r["case"]].append(r)
    report: dict = {}
    if parts["sweep"]:
        report["sweep"] = sweep_summary(parts["sweep"])
    if parts["nodes"]:
        report["nodes"] = {"rows": sorted(parts["nodes"], key=lambda r: (r["nodes"], POLICIES.index(r["policy"])))}
    if parts["gateways"]:
        report["gateways"] = gateway_summary(parts["gateways"])
    if parts["hot"]:
        report["hot"] = {"rows": parts["hot"]}
    return report


def hot_trace(plan: Plan, seed: int) -> tuple[list[TraceRequest], int]:
    """One hot tenant with `hot_share` of the traffic over background tenants (after the warm-up)."""
    base, skip = warmed(llmd(plan.hot_qps, plan.sweep_s, seed, plan.shape), plan.shape, plan)
    out = []
    for i, r in enumerate(base):
        if i >= skip and (i * 0.6180339887) % 1.0 < plan.hot_share:
            r = TraceRequest(r.arrival_s, r.output_len, prefix_group="hot", prefix_len=r.prefix_len,
                             suffix_len=r.suffix_len, tenant="hot")
        out.append(r)
    return out, skip


class TenantSpread(Collector):
    """Also counts, for one tenant, the nodes that computed its prompts, and its TTFTs."""

    def __init__(self, tenant: str, skip: int = 0) -> None:
        super().__init__(skip)
        self.tenant = tenant
        self.nodes: dict[str, int] = {}
        self.tenant_ttft: list[float] = []

    def __call__(self, req) -> None:
        if req.outcome == "ok" and req.tenant == self.tenant:
            self.nodes[req.computed_on] = self.nodes.get(req.computed_on, 0) + 1
            self.tenant_ttft.append(req.first_token_s - req.arrival_s)
        super().__call__(req)


def hot(plan: Plan, profile, seed: int) -> dict:
    trace, skip = hot_trace(plan, seed)
    rows = []
    for policy in POLICIES:
        c = TenantSpread("hot", skip)
        r = simulate(trace, plan.fleet(colocated=8, policy=policy), profile, seed, collector=c)
        total = sum(c.nodes.values())
        rows.append(row("hot", r, policy=policy, nodes=8, hot_share=plan.hot_share, qps=plan.hot_qps,
                        hot_nodes=len(c.nodes), hot_top_node_share=round(max(c.nodes.values()) / total, 3),
                        hot_ttft_p90_s=round(float(np.percentile(c.tenant_ttft, 90)), 4)))
        _log(rows[-1])
    return {"rows": rows}


def run(args: argparse.Namespace) -> int:
    from kvrelay.sim.plots import scale_plots

    if args.merge:
        from kvrelay.sim.plots import scale_plots

        report = {"merged_from": args.merge, **merge(args.merge)}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "scale.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({"scale": str(Path(args.out) / "scale.json"),
                          "plots": [str(p) for p in scale_plots(report, {}, Path(args.out))]}))
        return 0
    plan = QUICK if args.quick else Plan()
    if args.sweep_qps:
        plan = dataclasses.replace(plan, sweep_qps=tuple(float(q) for q in args.sweep_qps.split(",")))
    if args.node_counts:
        plan = dataclasses.replace(plan, node_counts=tuple(int(n) for n in args.node_counts.split(",")))
    if args.nodes_seconds:
        plan = dataclasses.replace(plan, nodes_s=args.nodes_seconds)
    profile = load_profile(args.profile)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    t0 = time.perf_counter()
    report: dict = {"profile": profile.name, "seed": args.seed, "plan": repr(plan)}
    cdfs: dict = {}
    if "sweep" in parts:
        report["sweep"] = sweep(plan, profile, args.seed, cdfs)
    if "nodes" in parts:
        report["nodes"] = nodes(plan, profile, args.seed)
    if "gateways" in parts:  # at the sweep's highest QPS within the SLO, when there was a sweep
        qps = report.get("sweep", {}).get("best_qps", plan.gateway_qps)
        report["gateways"] = gateways(plan, profile, args.seed, qps)
    if "hot" in parts:
        report["hot"] = hot(plan, profile, args.seed)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "scale.json").write_text(json.dumps(report, indent=1) + "\n")
    report["plots"] = [str(p) for p in scale_plots(report, cdfs, out)]
    print(json.dumps({k: report[k] for k in report if k not in ("sweep", "nodes", "gateways", "hot")}))
    return 0


def markdown(report: dict) -> str:
    """The study's tables, as docs/fleet.md shows them."""
    cols = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "output_tok_s", "prefix_hit_ratio", "would_hit_ratio",
            "load_imbalance", "failed")
    head = "| TTFT p50 (s) | p90 | p99 | output tok/s | hit ratio | cached somewhere | load imbalance | failed |"

    def table(rows: list[dict], keys: tuple[str, ...]) -> list[str]:
        out = ["| " + " | ".join(keys) + " " + head, "|" + " --- |" * (len(keys) + len(cols))]
        for r in rows:
            vals = [str(r.get(k, "")) for k in keys] + [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])
                                                        for c in cols]
            out.append("| " + " | ".join(vals) + " |")
        return out

    lines: list[str] = []
    for part, keys in (("sweep", ("qps", "policy")), ("nodes", ("nodes", "qps", "policy")),
                       ("gateways", ("case", "gateways", "policy")), ("hot", ("policy", "hot_nodes",
                                                                             "hot_top_node_share", "hot_ttft_p90_s"))):
        if part in report:
            lines += [f"### {part}", "", *table(report[part]["rows"], keys), ""]
    return "\n".join(lines)
