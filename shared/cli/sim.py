"""`kvrelay sim` (the fleet simulator: run, trace, calibrate, validate, scale) and `kvrelay plan` (docs/fleet.md).

    kvrelay sim trace llmd --qps 10 --duration 600 --out llmd-10.jsonl
    kvrelay sim run --trace llmd-10.jsonl --decode 8 --policy precise --profile h100 --seed 0
    kvrelay sim calibrate                       # measures this machine's engine: the `local` profile
    kvrelay sim validate                        # the simulator against real `kvrelay up` fleets here
    kvrelay sim scale --out docs/fleet          # routing at 8-256 nodes, every policy
    kvrelay plan --trace day.jsonl --slo-ttft-p90 2 --slo-itl-p90 0.05 --profile h100 --out deploy/k8s/overlays/x
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvrelay.cli.args import HelpFormatter, UsageError

POLICY_NAMES = ("precise", "approximate", "round_robin", "random", "least_load")


def register(subparsers) -> None:
    """Add `sim` and `plan` to the `kvrelay` subcommands."""
    p = subparsers.add_parser("sim", help="simulate a fleet: run a trace, make traces, calibrate, validate, scale",
                              description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="sim_command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="simulate a trace on a fleet shape; prints one JSON object",
                       formatter_class=HelpFormatter)
    r.add_argument("--trace", required=True, help="JSONL trace (kvrelay.sim.trace)")
    add_fleet_args(r)
    r.add_argument("--policy", default="precise", choices=POLICY_NAMES)
    r.add_argument("--restart-gateway", action="append", default=[], metavar="SECONDS:GATEWAY",
                   help="restart gateway GATEWAY (0-based) at SECONDS of simulated time (repeatable)")
    r.set_defaults(func=_run)

    t = sub.add_parser("trace", help="write a generated trace (llmd, chat, day)", formatter_class=HelpFormatter)
    t.add_argument("kind", choices=("llmd", "chat", "day"))
    t.add_argument("--out", required=True, help="JSONL file to write")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--qps", type=float, default=10.0, help="llmd: requests per second; chat: sessions per second")
    t.add_argument("--duration", type=float, default=600.0, help="llmd, chat: seconds of arrivals")
    t.add_argument("--requests", type=int, default=None, help="cut to this many requests")
    t.add_argument("--tenants", type=int, default=None, help="llmd, day: tenants (shared-prefix groups)")
    t.add_argument("--prefix-len", type=int, default=None)
    t.add_argument("--suffix-len", type=int, default=None)
    t.add_argument("--output-len", type=int, default=None)
    t.add_argument("--peak-qps", type=float, default=None, help="day: the rate at mid-day")
    t.add_argument("--day", type=float, default=None, help="day: seconds the day is compressed into")
    t.set_defaults(func=_trace)

    from kvrelay.sim import calibrate, scale, validate

    for module, name in ((calibrate, "calibrate"), (validate, "validate"), (scale, "scale")):
        c = sub.add_parser(name, help=module.HELP, description=module.__doc__, formatter_class=HelpFormatter)
        module.add_arguments(c)
        c.set_defaults(func=module.run)

    from kvrelay.sim import plan

    pl = subparsers.add_parser("plan", help=plan.HELP, description=plan.__doc__, formatter_class=HelpFormatter)
    plan.add_arguments(pl)
    pl.set_defaults(func=plan.run)


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    from kvrelay.sim.fleet import FleetSpec

    d = FleetSpec(decode=1)
    p.add_argument("--prefill", type=int, default=0, help="prefill nodes")
    p.add_argument("--decode", type=int, default=0, help="decode nodes")
    p.add_argument("--colocated", type=int, default=0, help="colocated nodes (each prefills and decodes)")
    p.add_argument("--gateways", type=int, default=d.gateways, help="gateways sharing the index")
    p.add_argument("--profile", default="h100", help="local (calibrated here), h100, h200, or a profile JSON")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per node (calibrated profiles)")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per node (default: the profile's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.scheduler.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=d.scheduler.max_num_seqs)
    p.add_argument("--kv-offload-blocks", type=int, default=d.offload_blocks,
                   help="per node: an offload tier of this many KV blocks in host memory, loaded back instead of "
                        "recomputed (the real one: --kv-offload-bytes); 0: none")
    p.add_argument("--offload-gbps", type=float, default=d.offload_bytes_per_s / 1e9,
                   help="loading from the tier, GB/s (host to device)")
    p.add_argument("--tier-routing", action=argparse.BooleanOptionalAction, default=d.tier_routing,
                   help="the tiers publish their blocks to the index and routing weighs them between resident and "
                        "missing (as in production); --no-tier-routing: routing blind to them")
    p.add_argument("--seed", type=int, default=0)


def spec_from_args(args: argparse.Namespace, **overrides):
    from kvrelay.sim.fleet import FleetSpec

    d = FleetSpec(decode=1)
    sched = dataclasses.replace(d.scheduler, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_num_seqs=args.max_num_seqs)
    values = dict(prefill=args.prefill, decode=args.decode, colocated=args.colocated, gateways=args.gateways,
                  threads=args.threads, kv_blocks=args.kv_blocks, scheduler=sched,
                  offload_blocks=args.kv_offload_blocks, offload_bytes_per_s=args.offload_gbps * 1e9,
                  tier_routing=args.tier_routing)
    values.update(overrides)
    try:
        return FleetSpec(**values)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _restarts(items: list[str]) -> tuple[tuple[float, int], ...]:
    out = []
    for item in items:
        at, _, g = item.partition(":")
        try:
            out.append((float(at), int(g or 0)))
        except ValueError:
            raise UsageError(f"expected SECONDS:GATEWAY, got {item!r}", flag="--restart-gateway") from None
    return tuple(out)


def _run(args: argparse.Namespace) -> int:
    from kvrelay.sim.run import simulate
    from kvrelay.sim.timemodel import load_profile
    from kvrelay.sim.trace import read_trace

    spec = spec_from_args(args, policy=args.policy, restarts=_restarts(args.restart_gateway))
    result = simulate(read_trace(args.trace), spec, load_profile(args.profile), args.seed)
    json.dump(result.to_json(), sys.stdout)
    sys.stdout.write("\n")
    return 0


def _trace(args: argparse.Namespace) -> int:
    from kvrelay.sim import workloads
    from kvrelay.sim.trace import write_trace

    def shape(base: workloads.Shape) -> workloads.Shape:
        given = {k: getattr(args, k) for k in ("tenants", "prefix_len", "suffix_len", "output_len")
                 if getattr(args, k) is not None}
        return dataclasses.replace(base, **given)

    if args.kind == "llmd":
        reqs = workloads.llmd(args.qps, args.duration, args.seed, shape(workloads.LLMD))
    elif args.kind == "chat":
        reqs = workloads.chat(args.qps, args.duration, args.seed)
    else:
        d = workloads.DayShape()
        day = dataclasses.replace(d, requests=shape(d.requests),
                                  **{k: v for k, v in (("peak_qps", args.peak_qps), ("day_s", args.day))
                                     if v is not None})
        reqs = workloads.day(args.seed, day)
    if args.requests is not None:
        reqs = workloads.fixed_count(reqs, args.requests)
    write_trace(args.out, reqs)
    print(json.dumps({"trace": args.out, "requests": len(reqs),
                      "duration_s": round(reqs[-1].arrival_s, 3) if reqs else 0.0}))
    return 0
