"""KV transfer throughput of each connector and transport, against a plain memcpy of the same bytes.

Moves the KV of N blocks for every layer of a SmolLM2-shaped cache (block 16, 3 KV heads, head 64, bf16)
between two processes, layer by layer as a prefill node does, and times each transfer from the first
send_blocks() to the acknowledged wait(). Each connector allocates its caches where it wants them
(kv_allocator(): shared memory for shm and auto), as a node's engine does. Prints JSON, each connector's
ratio to a memcpy of the same bytes timed in the same invocation, and writes it to --output.

`--device cuda` puts both sides' caches on the GPU (the two processes share it, as two nodes on one GPU do):
shm and auto then move KV by CUDA IPC, and the memcpy is a device-to-device copy of the same bytes (timed
between torch.cuda.synchronize() calls); shm-index copies with torch's gather/scatter kernels instead of the
fused one, and auto-nccl is auto without ucxx (which GPU images may lack). Cases that move host memory only
(ucx over tcp or shared memory, gloo, shm-2threads) are refused there.

The two sides of a wire transfer are two peer processes (`python -m kvrelay.bench.kv_transfer <folder>`,
started with ChildProcess) that share nothing but the machine, as two nodes would. Each hosts connectors and
answers calls (`PeerHost.op_<name>`) from this process over a unix socket in its private folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import platform
import random
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvrelay.bench.report import emit
from kvrelay.common.kv_allocator import KVAllocator
from kvrelay.common.process import ChildProcess
from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import KVConnector, _device_copy, create_connector
from kvrelay.kv_transfer.types import ConnectorConfig, TransferResult, torch_dtype

logger = logging.getLogger(__name__)

# case -> (connector name, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "local": ("local", {}),
    "shm": ("shm", {}),
    "shm-2threads": ("shm", {"copy_threads": 2}),
    "shm-index": ("shm", {"fused_copy": False}),  # CUDA: torch's gather/scatter kernels, not the fused one
    "auto": ("auto", {}),
    "auto-nccl": ("auto", {"remote": "nccl"}),  # its remote part needs no ucxx (on one GPU it goes unused)
    "ucx-tcp": ("ucx", {"transport": "tcp"}),
    "ucx-shm": ("ucx", {"transport": "shm"}),
    "gloo": ("nccl", {"backend": "gloo"}),
}


_TRANSPORTS = {"local": "in-process", "shm": "shared memory", "auto": "shared memory (same host)"}
_CUDA_CASES = ("local", "shm", "shm-index", "auto", "auto-nccl")  # what runs with --device cuda
_CUDA_DEFAULT = ("local", "shm", "shm-index", "auto-nccl")
_CPU_DEFAULT = tuple(c for c in CASES if c not in ("shm-2threads", "shm-index", "auto-nccl"))
_CUDA_TRANSPORTS = {"local": "in-process", "shm": "CUDA IPC", "auto": "CUDA IPC (same GPU)"}

HELP = "KV transfer GB/s per connector between two processes, and each one's ratio to memcpy"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "GB/s are 1e9 bytes of KV payload per second; ratio_to_memcpy = best GB/s / memcpy best GB/s."
    p.add_argument("--connectors", default=None,
                   help=f"comma-separated, from {', '.join(CASES)} (default: {','.join(_CPU_DEFAULT)}; with "
                        f"--device cuda: {','.join(_CUDA_DEFAULT)}; {','.join(_CUDA_CASES)} run there)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both sides' KV caches live; cuda: on this machine's GPU (shm and auto: CUDA IPC)")
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


# -- the peer processes ------------------------------------------------------------------------------------

_LEN = struct.Struct("<Q")
_SOCKET, _READY = "peer.sock", "ready"
_CONNECT_WAIT_S = 120.0  # how long a peer process waits for its parent to connect (and the parent for it)


def make_caches(
    layout: KVLayout, seed: int | None, device: str = "cpu", allocator: KVAllocator | None = None
) -> list[torch.Tensor]:
    """Deterministic caches: random from seed (the same values in any process), or zeros when seed is None;
    in memory from `allocator` when given (a connector's shared memory), else plain tensors."""
    shape, dtype = layout.cache_shape(), torch_dtype(layout)
    if allocator is not None:
        caches = allocator.allocate_kv_caches(layout.num_layers, shape, dtype, torch.device(device))
    else:
        caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for cache in caches:
            cache.copy_(torch.randn(shape, generator=gen).to(dtype))
    return caches


def _send(sock: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    (size,) = _LEN.unpack(_read(sock, _LEN.size))
    return pickle.loads(_read(sock, size))


def _read(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the other side closed the peer connection")
        data += chunk
    return bytes(data)


class PeerHost:
    """The connectors of a peer process, each under a key; `op_<name>` answers the parent's call `name`."""

    def __init__(self) -> None:
        self.connectors: dict[str, KVConnector] = {}
        self.caches: dict[str, list[torch.Tensor]] = {}

    def op_create(
        self, key: str, name: str, config: ConnectorConfig, layout: KVLayout, seed: int | None, device: str
    ) -> str:
        """A connector with caches from seed, allocated where it wants them; returns its address."""
        connector = create_connector(name, config)
        caches = make_caches(layout, seed, device, connector.kv_allocator())
        connector.register_kv_caches(layout, caches)
        self.connectors[key], self.caches[key] = connector, caches
        return connector.address

    def op_expect(self, key: str, transfer_id: str, dst: list[int], num_layers: int | None = None) -> None:
        self.connectors[key].expect(transfer_id, dst, num_layers)

    def op_send(
        self, key: str, peer: str, transfer_id: str, src: list[int], dst: list[int], layers: list[int] | None = None
    ) -> None:
        connector = self.connectors[key]
        for layer in range(connector.layout.num_layers) if layers is None else layers:
            connector.send_blocks(peer, transfer_id, layer, src, dst)

    def op_wait_received(self, key: str, transfer_id: str, timeout: float) -> TransferResult:
        return self.connectors[key].wait_received(transfer_id, timeout)

    def op_timed_sends(
        self, key: str, peer: str, transfer_ids: list[str], src: list[int], dst: list[int], timeout: float
    ) -> list[float]:
        """Seconds per transfer, first send_blocks to acknowledged wait(), one transfer after another."""
        seconds = []
        for transfer_id in transfer_ids:
            start = time.perf_counter()
            self.op_send(key, peer, transfer_id, src, dst)
            self.connectors[key].wait(transfer_id, timeout)
            seconds.append(time.perf_counter() - start)
        return seconds

    def op_close(self, key: str) -> None:
        self.caches.pop(key)
        self.connectors.pop(key).close()

    def op_exit(self) -> None:
        for key in list(self.connectors):
            self.op_close(key)


def serve_peer(host: PeerHost, folder: str) -> None:
    """A peer process's main: listen in `folder`, take its parent's connection, answer calls until "exit" (or
    the parent is gone)."""
    logging.basicConfig(level=logging.WARNING, format="peer %(process)d %(name)s %(levelname)s: %(message)s")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(Path(folder) / _SOCKET))
        listener.listen(1)
        listener.settimeout(_CONNECT_WAIT_S)
        (Path(folder) / _READY).touch()
        conn, _ = listener.accept()
    with conn:
        conn.settimeout(None)
        while True:
            try:
                op, args = _recv(conn)
            except EOFError:
                op, args = "exit", ()
            try:
                reply = (True, getattr(host, f"op_{op}")(*args))
            except Exception as e:  # noqa: BLE001 - every failure goes back to the parent, which raises it
                reply = (False, e)
            try:
                _send(conn, reply)
            except pickle.PicklingError:
                _send(conn, (False, RuntimeError(repr(reply[1]))))
            except OSError:
                pass  # the parent is gone
            if op == "exit":
                return


class Peer:
    """A peer process (`python -m <module> <folder>`, whose main runs serve_peer) and this process's handle
    on it: `call(op, *args)` returns what its host's op_<op> returned, or raises what it raised."""

    def __init__(self, module: str = "kvrelay.bench.kv_transfer", cwd: str | None = None) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="kvrelay-peer-"))  # private (0700): only we can connect
        self.process = ChildProcess.start("kv-peer", [sys.executable, "-m", module, str(self._folder)],
                                          log_dir=self._folder, cwd=cwd)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process.wait_ready((self._folder / _READY).exists, timeout_s=_CONNECT_WAIT_S)
            self._sock.connect(str(self._folder / _SOCKET))
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def call(self, op: str, *args: Any, timeout: float = 60.0) -> Any:
        self._sock.settimeout(timeout)
        try:
            _send(self._sock, (op, args))
            ok, value = _recv(self._sock)
        except TimeoutError:
            raise TimeoutError(f"peer process gave no answer to {op!r} within {timeout:.0f}s") from None
        if not ok:
            raise value
        return value

    def create(
        self, key: str, name: str, config: ConnectorConfig, layout: KVLayout, seed: int | None, device: str = "cpu"
    ) -> str:
        """Start a connector with caches from seed in the peer; returns its address."""
        return self.call("create", key, name, config, layout, seed, device, timeout=120)

    def kill(self) -> None:
        """Die abruptly, as a crashed node would."""
        self.process.kill()

    def close(self) -> None:
        if self.process.alive():
            try:
                self.call("exit", timeout=15)
            except (OSError, EOFError, TimeoutError) as e:
                logger.warning("peer process did not exit cleanly: %r\n%s", e, self.process.log_tail())
        self.process.stop(grace_s=10)
        self._sock.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the benchmark ------------------------------------------------------------------------------------------


def pick_blocks(pattern: str, blocks: int, cache_blocks: int, seed: int = 0) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(blocks)), list(range(cache_blocks - blocks, cache_blocks))
    rng = random.Random(seed)
    return rng.sample(range(cache_blocks), blocks), rng.sample(range(cache_blocks), blocks)


def memcpy_seconds(nbytes: int, repeats: int, device: str = "cpu") -> list[float]:
    """Seconds of one copy of nbytes within `device`'s memory (on CUDA: device to device, synchronized)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in (CPU), load the copy kernel (CUDA) before timing
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def local_seconds(
    layout: KVLayout, src: list[int], dst: list[int], args: argparse.Namespace, bar
) -> list[float]:
    sender, receiver = create_connector("local"), create_connector("local")
    sender.register_kv_caches(layout, make_caches(layout, 1, args.device))
    receiver.register_kv_caches(layout, make_caches(layout, None, args.device))
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
    hosts: tuple[Peer, Peer], case: str, layout: KVLayout, src: list[int], dst: list[int], args, bar
) -> list[float]:
    sender_host, receiver_host = hosts
    name, overrides = CASES[case]
    config = ConnectorConfig(name=name, transfer_timeout=args.timeout, **overrides)
    if args.max_message_kib:
        config.max_message_bytes = args.max_message_kib << 10
    address = receiver_host.create("rx", name, config, layout, None, args.device)
    sender_host.create("tx", name, config, layout, 1, args.device)
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


def summarize(
    case: str, pattern: str, nbytes: int, seconds: list[float], memcpy_best: float, device: str = "cpu"
) -> dict:
    best, median = nbytes / min(seconds) / 1e9, nbytes / statistics.median(seconds) / 1e9
    name, overrides = CASES.get(case, (case, {}))
    transports = _CUDA_TRANSPORTS if device == "cuda" else _TRANSPORTS
    return {
        "case": case,
        "connector": name,
        "transport": overrides.get("transport") or overrides.get("backend") or transports.get(name, name),
        "pattern": pattern,
        "gbps_best": round(best, 3),
        "gbps_median": round(median, 3),
        "ratio_to_memcpy": round(best / memcpy_best, 4),
        "seconds": [round(s, 5) for s in seconds],
    }


def pick_cases(connectors: str | None, device: str) -> list[str]:
    """The cases to run, in order; SystemExit naming the choices for one unknown or unable to run on device."""
    if connectors is None:
        return list(_CUDA_DEFAULT if device == "cuda" else _CPU_DEFAULT)
    cases = [c.strip() for c in connectors.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown connectors {unknown}; choose from {', '.join(CASES)}")
    host_only = [c for c in cases if device == "cuda" and c not in _CUDA_CASES]
    if host_only:
        raise SystemExit(f"{', '.join(host_only)}: host memory only; with --device cuda choose from "
                         f"{', '.join(_CUDA_CASES)}")
    return cases


def device_info(device: str, layout: KVLayout) -> dict:
    """What the caches live on; on CUDA also whether shm's receivers can use the fused copy kernel here (they
    check as this does, when their caches are registered; shm-index never uses it)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device here")
        props = torch.cuda.get_device_properties(0)
        fused = _device_copy.warm_up(torch.device("cuda", 0), layout.block_nbytes)
        return {"type": "cuda", "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "cuda": torch.version.cuda, "fused_copy": fused}
    return {"type": "cpu", "name": platform.processor() or platform.machine()}


def run(args: argparse.Namespace) -> int:
    cases = pick_cases(args.connectors, args.device)
    patterns = ["scattered", "contiguous"] if args.pattern == "both" else [args.pattern]
    layout = KVLayout("smollm2-shaped", "bfloat16", 16, args.layers, 3, 64, args.cache_blocks)
    device = device_info(args.device, layout)
    nbytes = layout.transfer_nbytes(args.blocks)
    memcpy = memcpy_seconds(nbytes, max(args.repeats, 5), args.device)
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the copy's buffers go back to the GPU, for the peers' caches
    memcpy_best = nbytes / min(memcpy) / 1e9
    rows = []
    total = len(cases) * len(patterns) * args.repeats
    hosts: tuple[Peer, Peer] | None = None
    with tqdm(total=total, desc="kv transfer", unit="transfer") as bar:
        try:
            for case in cases:
                for pattern in patterns:
                    bar.set_postfix_str(f"{case} {pattern}")
                    src, dst = pick_blocks(pattern, args.blocks, args.cache_blocks)
                    if case == "local":
                        seconds = local_seconds(layout, src, dst, args, bar)
                        if args.device == "cuda":
                            torch.cuda.empty_cache()  # its caches' memory back to the GPU, for the peers'
                    else:
                        # Started on first use: two processes importing torch would skew the local case.
                        hosts = hosts or (Peer(), Peer())
                        seconds = wire_seconds(hosts, case, layout, src, dst, args, bar)
                    rows.append(summarize(case, pattern, nbytes, seconds, memcpy_best, args.device))
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
        "device": device,
        "memcpy": {"kind": "device-to-device" if args.device == "cuda" else "host", "gbps_best": round(memcpy_best, 3),
                   "seconds": [round(s, 5) for s in memcpy]},
        "results": rows,
    }
    emit(report, args.output)
    return 0


if __name__ == "__main__":
    serve_peer(PeerHost(), sys.argv[1])
