"""The records and errors of KV transfer: what a transfer reports, how connectors are configured, and why a
transfer fails. Shared by the connector interface (base.py), its bookkeeping and every implementation."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from kvrelay.common.records import KVLayout

if TYPE_CHECKING:  # torch is imported where a tensor is met: `kvrelay up` and --help should not pay for it
    import torch


class TransferError(RuntimeError):
    """A transfer failed, timed out, or its peer could not be reached."""


class LayoutMismatchError(TransferError):
    """The two sides of a transfer disagree on the KV cache layout."""

    def __init__(self, message: str, mismatches: dict[str, tuple[object, object]] | None = None):
        super().__init__(message)
        self.mismatches = mismatches or {}

    def __reduce__(self) -> tuple:  # keep the mismatches when the error crosses a process boundary
        return (type(self), (str(self), self.mismatches))


def layout_mismatch(ours: KVLayout, theirs: KVLayout, our_name: str, their_name: str) -> LayoutMismatchError | None:
    """The error refusing a peer whose layout differs from ours (naming both sides' values), or None."""
    mismatches = ours.mismatches(theirs)
    if not mismatches:
        return None
    return LayoutMismatchError(KVLayout.describe(mismatches, our_name, their_name), mismatches)


def torch_dtype(layout: KVLayout) -> torch.dtype:
    import torch

    return getattr(torch, layout.dtype)


@dataclass(frozen=True)
class TransferResult:
    transfer_id: str
    nbytes: int  # KV payload only (headers and acks excluded)
    seconds: float  # sender: first enqueue to last ack; receiver: first layer arrival to last layer in place
    num_layers: int
    # Sender: the last layer handed over -> its ack, i.e. what the transfer adds once compute is done.
    last_layer_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass
class ConnectorMetrics:
    """Plain counters; the node exports them (e.g. as kvrelay:* Prometheus metrics)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_sent: int = 0
    transfers_received: int = 0
    send_seconds: float = 0.0
    recv_seconds: float = 0.0
    failures: int = 0  # transfers that ended in an error or timeout, as seen by wait()/wait_received()
    refused_handshakes: int = 0  # peers refused (layout mismatch) or unreachable at connection time
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass
class ConnectorConfig:
    name: str = "local"  # "auto" | "shm" | "ucx" | "nccl" | "local"
    host: str = "127.0.0.1"  # interface the receiver listens on and advertises
    port: int = 0  # 0: pick a free port
    # ucx: "tcp", "shm" (shared memory; UCX still needs tcp for the connection handshake) or "auto"
    # (UCX picks, including CUDA transports). ucx_tls overrides with a raw UCX_TLS value.
    transport: str = "tcp"
    ucx_tls: str | None = None
    # ucx data endpoints: None = on for tcp/auto, off for shm (UCX drops shm lanes when error handling is on).
    error_handling: bool | None = None
    backend: str | None = None  # nccl connector: "nccl" | "gloo"; None = nccl for CUDA caches, else gloo
    connect_timeout: float = 5.0
    transfer_timeout: float = 30.0  # default for wait()/wait_received() and for each wire operation
    max_inflight_layers: int = 4  # sender: layers on the wire at once (bounds staging memory)
    max_direct_runs: int = 2  # send block runs zero-copy when a layer has at most this many, else gather
    max_message_bytes: int = 1 << 20  # split a layer's data into wire messages of at most this size
    # shm: where its control sockets live (None: /dev/shm, else the temp dir). Two nodes use shm only when
    # they see the same folder on the same boot (the host id), e.g. pods sharing /dev/shm.
    shm_dir: str | None = None
    remote: str = "ucx"  # auto: the connector to peers on other hosts ("ucx" or "nccl")
    # shm: threads that copy one received layer of 1 MiB or more (its pieces split between them). More than
    # one helps only with idle cores: on busy cores two threads copy slower than one.
    copy_threads: int = 1
    # shm with CUDA caches: copy a received layer's scattered blocks with one fused Triton kernel (each byte read
    # and written once) where it compiles and checks out, else (or when off) with torch's gather and scatter.
    fused_copy: bool = True

    def max_message_blocks(self, layout: KVLayout) -> int:
        return max(1, self.max_message_bytes // layout.block_nbytes)
