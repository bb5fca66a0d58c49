"""`kvrelay bench soak`: a fleet under mixed load while its nodes crash, checked token for token.

Lifecycle:
1. Start `kvrelay up --prefill P --decode D --restart` (its log beside the results); the launcher restarts
   every node the soak kills.
2. Reference: each request of a fixed set (chat and completions, streamed and not, greedy and seeded)
   once, fault-free.
3. Burst (--burst N): N chat requests at once (80-400-token prompts, --max-tokens output) mixed with
   malformed ones. Every answer must be a success, a 4xx with an OpenAI error body, or a 429/503 with
   Retry-After; at the default bounds every valid one must succeed.
4. Soak: --concurrency workers send requests from the set for --duration seconds while, every --kill-every
   seconds (once every node is back in rotation), a random prefill or decode node gets SIGKILL (--fault
   hang: SIGSTOP for --hang-seconds, then SIGCONT; mixed: either). Greedy and seeded answers must equal
   their reference; a failed request is one the client saw fail.
5. Settle: wait until every node is back and idle, then report each node's load. Blocks in use must be 0.

    kvrelay bench soak --duration 600 --kill-every 30
    kvrelay bench soak --duration 0 --burst 150 --up-args "--max-waiting-requests 8 --max-concurrent-requests 40"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import random
import re
import shlex
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx

from kvrelay.bench.fleet import FleetProcess
from kvrelay.bench.report import emit
from kvrelay.bench.soak_workload import MALFORMED, Outcome, SoakRequest, Tally, build_requests, send
from kvrelay.common import wire
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

HELP = "crash nodes under mixed load: failed requests, token-exact mismatches, leaked KV blocks"
_STARTED = re.compile(r"started (\S+) \(pid (\d+)\)")


# -------------------------------------------------------------------------------------------- fleet


class Nodes:
    """The fleet's node processes (from the launcher's log: it logs every start, restarts included) and
    their load (from the gateway's /health, then each node's GetLoad)."""

    def __init__(self, fleet: FleetProcess, num_nodes: int) -> None:
        self.fleet, self.num_nodes = fleet, num_nodes
        self.base = fleet.base_url.removesuffix("/v1")

    def pids(self) -> dict[str, int]:
        text = self.fleet.log_path.read_text(errors="replace")
        latest = {name: int(pid) for name, pid in _STARTED.findall(text) if name != "gateway"}
        return {name: pid for name, pid in latest.items() if _alive(pid)}

    def health(self) -> dict:
        try:
            return httpx.get(self.base + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def all_routable(self) -> bool:
        h = self.health()
        return h.get("prefill_nodes", 0) + h.get("decode_nodes", 0) >= self.num_nodes

    def loads(self) -> list[dict]:
        out = []
        for node in self.health().get("nodes", []):
            try:
                with grpc.insecure_channel(node["address"]) as channel:
                    load = wire.load_from_proto(pb_grpc.EngineStub(channel).GetLoad(pb.LoadRequest(), timeout=5))
            except grpc.RpcError as e:
                out.append({"node_id": node["node_id"], "role": node["role"], "error": e.code().name})
                continue
            out.append({"node_id": node["node_id"], "role": node["role"], "running": load.num_running,
                        "waiting": load.num_waiting, "reserved": load.num_reserved, "held": load.num_held,
                        "blocks_in_use": load.total_kv_blocks - load.free_kv_blocks,
                        "total_blocks": load.total_kv_blocks, "kv_cache_usage": round(load.kv_cache_usage, 4)})
        return out

    def settle(self, timeout_s: float) -> list[dict]:
        """Wait until every node is routable and idle (leases may take their time); the last loads."""
        deadline = time.monotonic() + timeout_s
        while True:
            loads = self.loads() if self.all_routable() else []
            idle = len(loads) >= self.num_nodes and all(
                "error" not in n and not (n["running"] or n["waiting"] or n["reserved"] or n["held"]
                                          or n["blocks_in_use"]) for n in loads)
            if idle or time.monotonic() > deadline:
                return loads or self.loads()
            time.sleep(1.0)

    def metrics(self) -> dict[str, float]:
        wanted = ("kvrelay:migrations_total", "kvrelay:retries_total", "kvrelay:rejected_requests_total",
                  "kvrelay:breaker_trips_total", "kvrelay:request_timeouts_total", "kvrelay:index_errors_total")
        out: dict[str, float] = dict.fromkeys(wanted, 0.0)
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in wanted:
                out[name] = out.get(name, 0.0) + float(line.rpartition(" ")[2])
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


# ----------------------------------------------------------------------------------------- phases


def reference(base_url: str, requests: list[SoakRequest]) -> dict[str, str]:
    """Each checked request's fault-free text (one at a time, so nothing but the request itself runs)."""
    out = {}
    with httpx.Client() as client:
        for req in requests:
            if req.checked:
                outcome = send(client, base_url, req.endpoint, req.body)
                if outcome.verdict != "ok":
                    raise RuntimeError(f"reference run of {req.name} failed: {outcome.status} {outcome.error}")
                out[req.name] = outcome.text
    return out


def burst(base_url: str, requests: list[SoakRequest], malformed_every: int) -> dict:
    """All at once, valid and malformed mixed; every answer judged as a client sees it."""
    jobs: list[tuple[str, object, bool]] = []
    for i, req in enumerate(requests):
        jobs.append((req.endpoint, req.body, True))
        if malformed_every and i % malformed_every == 0:
            endpoint, body = MALFORMED[(i // malformed_every) % len(MALFORMED)]
            jobs.append((endpoint, body, False))
    valid, bad_input = Tally(), Tally()
    limits = httpx.Limits(max_connections=len(jobs) + 8)
    t0 = time.monotonic()
    with httpx.Client(limits=limits) as client, concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {pool.submit(send, client, base_url, e, b): ok for e, b, ok in jobs}
        for future in concurrent.futures.as_completed(futures):
            (valid if futures[future] else bad_input).add(future.result())
    report = {"seconds": round(time.monotonic() - t0, 1), "valid": valid.report(), "malformed": bad_input.report()}
    report["bad"] = valid.verdicts.get("bad", 0) + bad_input.verdicts.get("bad", 0) + bad_input.verdicts.get("ok", 0)
    return report


class Faults:
    """Every `every_s` seconds, once all nodes are back in rotation, one node crashes (or hangs)."""

    def __init__(self, nodes: Nodes, every_s: float, kind: str, hang_s: float, seed: int) -> None:
        self.nodes, self.every_s, self.kind, self.hang_s = nodes, every_s, kind, hang_s
        self.rng = random.Random(seed)
        self.log: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self.t0 = time.monotonic()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            deadline = time.monotonic() + self.every_s
            while not self.nodes.all_routable() and time.monotonic() < deadline and not self.stop.is_set():
                time.sleep(0.5)
            pids = self.nodes.pids()
            if self.stop.is_set() or not pids or not self.nodes.all_routable():
                continue
            name = self.rng.choice(sorted(pids))
            kind = self.rng.choice(["kill", "hang"]) if self.kind == "mixed" else self.kind
            self.log.append({"t": round(time.monotonic() - self.t0, 1), "node": name, "pid": pids[name], "fault": kind})
            logger.info("soak: %s %s (pid %d)", kind, name, pids[name])
            if kind == "kill":
                os.kill(pids[name], signal.SIGKILL)
            else:
                os.kill(pids[name], signal.SIGSTOP)
                time.sleep(self.hang_s)
                os.kill(pids[name], signal.SIGCONT)


def soak(base_url: str, requests: list[SoakRequest], ref: dict[str, str], args, faults: Faults) -> Tally:
    tally, lock = Tally(), threading.Lock()
    end = time.monotonic() + args.duration

    def worker(w: int) -> None:
        rng = random.Random(args.seed + w)
        with httpx.Client() as client:
            while time.monotonic() < end:
                req = rng.choice(requests)
                outcome: Outcome = send(client, base_url, req.endpoint, req.body)
                with lock:
                    tally.add(outcome, req, ref)

    workers = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(args.concurrency)]
    faults.thread.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    faults.stop.set()
    faults.thread.join(args.hang_seconds + 10)
    return tally


# -------------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.model_files.resolve import resolve_model

    tokenizer = Tokenizer(resolve_model(args.model).path)
    flags = ["--model", args.model, "--prefill", str(args.prefill), "--decode", str(args.decode), "--restart",
             "--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory), *shlex.split(args.up_args or "")]
    out_dir = Path(args.output_dir)
    report: dict = {"fleet": {"kvrelay_up_flags": flags, "cpu_count": os.cpu_count()}, "duration_s": args.duration,
                    "kill_every_s": args.kill_every, "fault": args.fault, "concurrency": args.concurrency}
    with FleetProcess(flags, out_dir / "soak-fleet.log", args.ready_timeout) as fleet:
        nodes = Nodes(fleet, args.prefill + args.decode)
        requests = build_requests(tokenizer, args.num_prompts, args.seed, args.max_tokens)
        if args.burst:
            burst_set = build_requests(tokenizer, args.burst, args.seed + 1, args.max_tokens, endpoints=("chat",))
            report["burst"] = burst(fleet.base_url, burst_set, args.malformed_every)
            report["burst"]["nodes_after"] = nodes.settle(args.settle_timeout)
        if args.duration > 0:
            ref = reference(fleet.base_url, requests)
            report["reference_requests"] = len(ref)
            faults = Faults(nodes, args.kill_every, args.fault, args.hang_seconds, args.seed)
            t0 = time.monotonic()
            report["soak"] = soak(fleet.base_url, requests, ref, args, faults).report()
            report["soak"]["seconds"] = round(time.monotonic() - t0, 1)
            report["faults"] = faults.log
        report["gateway"] = nodes.metrics()
        report["nodes_after"] = nodes.settle(args.settle_timeout)
    report["leaked_blocks"] = sum(n.get("blocks_in_use", 0) for n in report["nodes_after"])
    soak_ok = "soak" not in report or (report["soak"]["failed"] == 0 and report["soak"]["mismatches"] == 0)
    burst_ok = "burst" not in report or report["burst"]["bad"] == 0
    report["ok"] = soak_ok and burst_ok and report["leaked_blocks"] == 0
    emit(report, out_dir / "soak.json")
    return 0 if report["ok"] else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load with faults (0: burst only)")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--fault", choices=["kill", "hang", "mixed"], default="kill",
                   help="kill: SIGKILL (the launcher restarts the node); hang: SIGSTOP for --hang-seconds")
    p.add_argument("--hang-seconds", type=float, default=8.0, help="how long a hung node stays stopped")
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight during the soak")
    p.add_argument("--num-prompts", type=int, default=24, help="distinct requests the soak cycles through")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--burst", type=int, default=0, help="first, this many chat requests at once (0: none)")
    p.add_argument("--malformed-every", type=int, default=10, help="burst: one malformed request per this many")
    p.add_argument("--prefill", type=int, default=2, help="prefill nodes")
    p.add_argument("--decode", type=int, default=2, help="decode nodes")
    p.add_argument("--model", default="default", help="passed to `kvrelay up --model`")
    p.add_argument("--dtype", default="float32", help="passed to `kvrelay up --dtype`")
    p.add_argument("--kv-cache-memory", type=int, default=48 * 2**20, help="bytes of KV cache per node")
    p.add_argument("--up-args", default=None, help="more `kvrelay up` flags (bounds: --max-waiting-requests, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle-timeout", type=float, default=180.0,
                   help="seconds to wait for every node to be back and idle (KV leases may run their course)")
    p.add_argument("--output-dir", default="bench/results", help="soak.json and the fleet's log go here")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds the fleet may take to come up")

