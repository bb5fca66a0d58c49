"""`kvrelay bench soak`: a fleet under mixed load while its nodes crash, checked token for token.

1. Start `kvrelay up --prefill P --decode D --restart` (its log beside the results); the launcher restarts every
   node the soak kills.
2. Reference: each request of a fixed set once, fault-free. The set mixes chat and completions, streamed and
   not, greedy, seeded and unseeded sampling, over corpus prompts of 80-400 tokens.
3. Burst (--burst N): N chat requests at once mixed with malformed ones; then every node must settle.
4. Soak: --concurrency requests in flight from the set for --duration seconds while, every --kill-every seconds
   (once every node is back in rotation), a random prefill or decode node gets SIGKILL (--fault hang: SIGSTOP
   for --hang-seconds, then SIGCONT; mixed: either; gateway: a gateway gets SIGKILL; roll: `kvrelay up`
   gets SIGHUP and restarts every process, one at a time). Greedy and seeded answers must equal their reference.
   Each request goes out under an Idempotency-Key; one whose connection breaks is sent again under it, a
   stream with the Last-Event-ID it read (with --up-args "--gateways 2", the other gateway goes on with it).
5. Settle: wait until every node is back and idle, then report each node's load. Blocks in use must be 0.

An answer is judged as a client sees it:
  ok         200 with the whole answer (a stream ending in [DONE], no error event);
  client     a 4xx other than 429 with an OpenAI error body (malformed requests expect this);
  rejected   429 or 503 with Retry-After and an OpenAI error body (overload, a fleet with no room);
  bad        anything else: another 5xx, a dropped connection, a stream without [DONE] or with an error.
A failed request is one that is neither ok nor client.

    kvrelay bench soak --duration 600 --kill-every 30
    kvrelay bench soak --duration 0 --burst 150 --up-args "--max-waiting-requests 8 --max-concurrent-requests 40"
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import shlex
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench.client import Client, Reply
from kvrelay.bench.fleet import Server
from kvrelay.bench.report import emit, machine
from kvrelay.bench.workload import TextSource
from kvrelay.common.process import freeze
from kvrelay.common.units import byte_size

logger = logging.getLogger(__name__)

HELP = "crash nodes under mixed load: failed requests, token-exact mismatches, leaked KV blocks"
MALFORMED: list[tuple[str, dict | bytes]] = [  # (endpoint, body): each must be a 4xx with an OpenAI error body
    ("chat", {"messages": [], "max_tokens": 4}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}),
    ("chat", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    ("completions", {"prompt": [10**9], "max_tokens": 4}),
    ("completions", b"{not json"),
]
GATEWAY_COUNTERS = ("kvrelay:migrations_total", "kvrelay:retries_total", "kvrelay:rejected_requests_total",
                    "kvrelay:breaker_trips_total", "kvrelay:request_timeouts_total", "kvrelay:index_errors_total")


def verdict(reply: Reply) -> str:
    if reply.status == 200:
        return "ok" if reply.ok else "bad"
    if reply.status in (429, 503):
        return "rejected" if reply.headers.get("retry-after") and reply.error_body else "bad"
    return "client" if 400 <= reply.status < 500 and reply.error_body else "bad"


@dataclass(frozen=True)
class SoakRequest:
    name: str
    endpoint: str  # "chat" | "completions"
    body: dict
    checked: bool  # greedy or seeded: the text must equal the fault-free reference


def build_requests(tokenizer, count: int, seed: int, max_tokens: int, endpoints: tuple[str, ...] = (
        "chat", "completions")) -> list[SoakRequest]:
    """`count` requests cycling through every mix of endpoint x stream x sampling, prompts of 80-400 tokens."""
    rng, source = random.Random(seed), TextSource(tokenizer)
    kinds = [(e, s, m) for m in ("greedy", "seeded", "random") for e in endpoints for s in (False, True)]
    out = []
    for i in range(count):
        endpoint, stream, mode = kinds[i % len(kinds)]
        text = source.window(rng, rng.randint(80, 400))
        body = {"max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
                **{"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 1000 + i},
                   "random": {"temperature": 0.8}}[mode],
                **({"messages": [{"role": "user", "content": text}]} if endpoint == "chat" else {"prompt": text})}
        out.append(SoakRequest(f"{i}-{endpoint}-{'stream' if stream else 'unary'}-{mode}", endpoint, body,
                               mode != "random"))
    return out


@dataclass
class Tally:
    """Counts of verdicts, errors by message, and reference mismatches."""

    verdicts: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    refused: int = 0  # attempts refused for want of a gateway, then sent again (not counted as requests)
    resumed: int = 0  # requests cut mid-way (their gateway died), then sent again under their key or resumed

    def add(self, reply: Reply, req: SoakRequest | None = None, reference: dict[str, str] | None = None) -> None:
        self.verdicts[v := verdict(reply)] += 1
        if v != "ok":
            self.errors[f"{reply.status} {reply.error[:120]}" + ("" if reply.done else " (no [DONE])")] += 1
        if v == "ok" and req is not None and req.checked and reference and req.name in reference:
            self.checked += 1
            if reply.text != reference[req.name]:
                self.mismatches.append(req.name)

    def report(self) -> dict:
        sent = sum(self.verdicts.values())
        return {"sent": sent, "completed": self.verdicts["ok"], "failed": sent - self.verdicts["ok"]
                - self.verdicts["client"], "verdicts": dict(sorted(self.verdicts.items())), "errors": dict(self.errors),
                "refused_then_retried": self.refused, "cut_then_resumed": self.resumed,
                "checked_against_reference": self.checked, "mismatches": len(self.mismatches),
                "mismatched_requests": self.mismatches[:20]}


# -- the fleet's nodes --------------------------------------------------------------------------------------


def node_loads(fleet: Server) -> list[dict]:
    """Each node the gateway lists, with its load from its own GetLoad."""
    import grpc

    from kvrelay.common import wire
    from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
    from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

    out = []
    for node in fleet.health().get("nodes", []):
        row = {"node_id": node["node_id"], "role": node["role"]}
        try:
            with fleet.node_channel(node["address"]) as channel:
                load = wire.load_from_proto(pb_grpc.EngineStub(channel).GetLoad(pb.LoadRequest(), timeout=5))
        except grpc.RpcError as e:
            out.append({**row, "error": e.code().name})
            continue
        out.append({**row, "running": load.num_running, "waiting": load.num_waiting, "reserved": load.num_reserved,
                    "held": load.num_held, "blocks_in_use": load.total_kv_blocks - load.free_kv_blocks,
                    "total_blocks": load.total_kv_blocks, "kv_cache_usage": round(load.kv_cache_usage, 4)})
    return out


def all_routable(fleet: Server, num_nodes: int) -> bool:
    health = fleet.health()
    return health.get("prefill_nodes", 0) + health.get("decode_nodes", 0) >= num_nodes


def settle(fleet: Server, num_nodes: int, timeout_s: float) -> list[dict]:
    """Wait until every node is routable and idle (leases may take their time); the last loads."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = node_loads(fleet) if all_routable(fleet, num_nodes) else []
        if (len(loads) >= num_nodes and all("error" not in n and not any(
                n[k] for k in ("running", "waiting", "reserved", "held", "blocks_in_use")) for n in loads)) \
                or time.monotonic() > deadline:
            return loads or node_loads(fleet)
        time.sleep(1.0)


class Faults:
    """Every `every_s` seconds, once all nodes are back in rotation, one node crashes (or hangs)."""

    def __init__(self, fleet: Server, num_nodes: int, every_s: float, kind: str, hang_s: float, seed: int) -> None:
        self.fleet, self.num_nodes, self.every_s, self.kind, self.hang_s = fleet, num_nodes, every_s, kind, hang_s
        self.rng, self.log, self.stop = random.Random(seed), [], threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self.t0 = time.monotonic()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            deadline = time.monotonic() + self.every_s
            while not all_routable(self.fleet, self.num_nodes) and time.monotonic() < deadline \
                    and not self.stop.is_set():
                time.sleep(0.5)
            running = self.fleet.pids()
            pids = {n: p for n, p in running.items() if not n.startswith("gateway")}
            if self.stop.is_set() or not pids or not all_routable(self.fleet, self.num_nodes):
                continue
            kind = self.rng.choice(["kill", "hang"]) if self.kind == "mixed" else self.kind
            if kind == "roll":
                self._roll()
                continue
            if kind == "gateway":  # the launcher (--restart) starts it again
                pids = {n: p for n, p in running.items() if n.startswith("gateway")}
            name = self.rng.choice(sorted(pids))
            self.log.append({"t": round(time.monotonic() - self.t0, 1), "node": name, "pid": pids[name], "fault": kind})
            logger.info("soak: %s %s (pid %d)", kind, name, pids[name])
            if kind in ("kill", "gateway"):
                os.kill(pids[name], signal.SIGKILL)
            else:
                freeze(pids[name])
                time.sleep(self.hang_s)
                os.kill(pids[name], signal.SIGCONT)

    def _roll(self) -> None:
        """A rolling restart of the whole fleet (SIGHUP to `kvrelay up`), waited for to its end."""
        ended = self._rolls_ended()
        start = time.monotonic()
        self.log.append({"t": round(start - self.t0, 1), "node": "all", "fault": "roll"})
        logger.info("soak: rolling restart")
        self.fleet.process.send_signal(signal.SIGHUP)
        while self._rolls_ended() == ended and not self.stop.wait(1.0):
            pass
        self.log[-1]["seconds"] = round(time.monotonic() - start, 1)

    def _rolls_ended(self) -> int:
        text = self.fleet.process.log_text()
        return text.count("rolling restart done") + text.count("rolling restart stopped")


# -- phases ---------------------------------------------------------------------------------------------------


async def reference(client: Client, requests: list[SoakRequest]) -> dict[str, str]:
    """Each checked request's fault-free text, one at a time (so nothing but the request itself runs)."""
    out = {}
    for req in (r for r in requests if r.checked):
        reply = await client.post(req.endpoint, req.body)
        if not reply.ok:
            raise RuntimeError(f"reference run of {req.name} failed: {reply.status} {reply.error}")
        out[req.name] = reply.text
    return out


async def burst(client: Client, requests: list[SoakRequest], malformed_every: int) -> dict:
    """All at once, valid and malformed mixed; every answer judged as a client sees it."""
    jobs = [(r.endpoint, r.body, True) for r in requests]
    if malformed_every:
        jobs += [(*MALFORMED[k % len(MALFORMED)], False) for k in range(0, -(-len(requests) // malformed_every))]
    t0 = time.monotonic()
    replies = await asyncio.gather(*(client.post(endpoint, body) for endpoint, body, _ in jobs))
    valid, bad_input = Tally(), Tally()
    for (_, _, is_valid), reply in zip(jobs, replies):
        (valid if is_valid else bad_input).add(reply)
    return {"seconds": round(time.monotonic() - t0, 1), "valid": valid.report(), "malformed": bad_input.report(),
            "bad": valid.verdicts["bad"] + bad_input.verdicts["bad"] + bad_input.verdicts["ok"]}


def _refused(reply: Reply) -> bool:
    return reply.status == 0 and "Connect call failed" in reply.error


async def send(client: Client, req: SoakRequest, tally: Tally, until: float) -> Reply:
    """One request as a careful client sends it: under an Idempotency-Key, sent again when no gateway listened
    (as the openai SDK retries a refused connection), and, when its connection broke (its gateway died),
    sent again under the same key: a stream with the `Last-Event-ID` it had read, so it gets the rest (any
    gateway goes on with the running sequence); the text is what it read over all its attempts."""
    key = f"soak-{uuid.uuid4().hex}"
    reply = await client.post(req.endpoint, req.body, key)
    text, cuts = "", 0
    while reply.cut and cuts < 5 and time.monotonic() < until:
        if _refused(reply):
            tally.refused += 1
            await asyncio.sleep(0.25)
        else:
            tally.resumed += 1
            cuts += 1
        after = reply.last_event_id if req.body.get("stream") else None
        text = text + reply.text if after is not None else ""  # without an event id, the answer comes whole
        reply = await client.post(req.endpoint, req.body, key, after)
    reply.text = text + reply.text
    return reply


async def soak(client: Client, requests: list[SoakRequest], ref: dict[str, str], args, faults: Faults) -> Tally:
    tally, end = Tally(), time.monotonic() + args.duration

    async def worker(w: int) -> None:
        rng = random.Random(args.seed + w)
        while time.monotonic() < end:
            req = rng.choice(requests)
            tally.add(await send(client, req, tally, end + args.settle_timeout), req, ref)

    faults.thread.start()
    try:
        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    finally:
        faults.stop.set()
        await asyncio.to_thread(faults.thread.join, args.hang_seconds + 10)
    return tally


async def phases(fleet: Server, tokenizer, args: argparse.Namespace, report: dict) -> None:
    num_nodes = args.prefill + args.decode
    async with Client(fleet.base_url, timeout_s=600.0) as client:
        if args.burst:
            burst_set = build_requests(tokenizer, args.burst, args.seed + 1, args.max_tokens, endpoints=("chat",))
            report["burst"] = await burst(client, burst_set, args.malformed_every)
            report["burst"]["nodes_after"] = await asyncio.to_thread(settle, fleet, num_nodes, args.settle_timeout)
        if args.duration > 0:
            requests = build_requests(tokenizer, args.num_prompts, args.seed, args.max_tokens)
            ref = await reference(client, requests)
            report["reference_requests"] = len(ref)
            faults = Faults(fleet, num_nodes, args.kill_every, args.fault, args.hang_seconds, args.seed)
            t0 = time.monotonic()
            report["soak"] = (await soak(client, requests, ref, args, faults)).report()
            report["soak"]["seconds"], report["faults"] = round(time.monotonic() - t0, 1), faults.log


def run(args: argparse.Namespace) -> int:
    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.model_files.resolve import resolve_model

    tokenizer = Tokenizer(resolve_model(args.model).path)
    flags = ["--model", args.model, "--prefill", str(args.prefill), "--decode", str(args.decode), "--restart",
             "--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory), *shlex.split(args.up_args or "")]
    report: dict = {"fleet": {"kvrelay_up_flags": flags, "machine": machine()}, "duration_s": args.duration,
                    "kill_every_s": args.kill_every, "fault": args.fault, "concurrency": args.concurrency}
    with Server.up(flags, log_dir=args.output_dir, timeout_s=args.ready_timeout, name="soak-fleet") as fleet:
        asyncio.run(phases(fleet, tokenizer, args, report))
        # Settled first: a gateway killed at the end is back (up --restart) before its metrics are read.
        report["nodes_after"] = settle(fleet, args.prefill + args.decode, args.settle_timeout)
        metrics = fleet.metrics()  # the last gateway's: a restarted one counts from zero
        report["gateway"] = {name: metrics.value(name) or 0.0 for name in GATEWAY_COUNTERS}
    report["leaked_blocks"] = sum(n.get("blocks_in_use", 0) for n in report["nodes_after"])
    soak_ok = "soak" not in report or (report["soak"]["failed"] == 0 and report["soak"]["mismatches"] == 0)
    report["ok"] = soak_ok and report.get("burst", {}).get("bad", 0) == 0 and report["leaked_blocks"] == 0
    emit(report, Path(args.output_dir) / "soak.json")
    return 0 if report["ok"] else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load with faults (0: burst only)")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--fault", choices=["kill", "hang", "mixed", "gateway", "roll"], default="kill",
                   help="kill: SIGKILL to a node (the launcher restarts it); hang: SIGSTOP for --hang-seconds; mixed: "
                        "either; gateway: SIGKILL to the gateway (restarted likewise); roll: a rolling restart of "
                        "every process (SIGHUP to kvrelay up), the next one --kill-every seconds after it ended")
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
    p.add_argument("--kv-cache-memory", type=byte_size, default=48 * 2**20, help="bytes of KV cache per node")
    p.add_argument("--up-args", default=None, help="more `kvrelay up` flags (bounds: --max-waiting-requests, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle-timeout", type=float, default=180.0,
                   help="seconds to wait for every node to be back and idle (KV leases may run their course)")
    p.add_argument("--output-dir", default="bench/results", help="soak.json and the fleet's log go here")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds the fleet may take to come up")
