"""The KV transfer interface: move given blocks of every layer from a prefill cache into a decode cache.

Sender side (prefill): `send_blocks` once per layer as soon as that layer's KV is written; it only enqueues,
so the wire transfer of layer L overlaps the compute of layer L+1. `wait` then blocks until the receiver has
acknowledged every layer. Receiver side (decode): `expect` names the reserved destination blocks (a sender may
write nowhere else) and `wait_received` blocks until every layer is in place, after which the request can be
admitted. Before the first transfer between two connectors they exchange `KVLayout`s and refuse a mismatch.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields

import torch

from shared.attention.base import kv_cache_shape


class TransferError(RuntimeError):
    """A transfer failed, timed out, or its peer could not be reached."""


class LayoutMismatchError(TransferError):
    """The two sides of a transfer disagree on the KV cache layout."""

    def __init__(self, message: str, mismatches: dict[str, tuple[object, object]] | None = None):
        super().__init__(message)
        self.mismatches = mismatches or {}

    def __reduce__(self) -> tuple:  # keep the mismatches when the error crosses a process boundary
        return (type(self), (str(self), self.mismatches))


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    num_blocks: int  # allowed to differ between peers: only block ids cross the wire

    @classmethod
    def for_caches(cls, model_id: str, kv_caches: list[torch.Tensor]) -> KVLayout:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_caches[0].shape
        dtype = str(kv_caches[0].dtype).removeprefix("torch.")
        return cls(model_id, dtype, block_size, len(kv_caches), num_kv_heads, head_size, num_blocks)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of keys (or of values) in one layer."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_size * itemsize

    def transfer_nbytes(self, num_blocks: int, num_layers: int | None = None) -> int:
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * num_blocks * layers * self.block_nbytes

    def cache_shape(self) -> tuple[int, ...]:
        return kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def check_compatible(self, other: KVLayout, self_name: str = "local", other_name: str = "peer") -> None:
        """Raise LayoutMismatchError naming both sides' values of every differing field."""
        error = self.mismatch(other, self_name, other_name)
        if error is not None:
            raise error

    def mismatch(self, other: KVLayout, self_name: str, other_name: str) -> LayoutMismatchError | None:
        mismatches = {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if f.name != "num_blocks" and getattr(self, f.name) != getattr(other, f.name)
        }
        if not mismatches:
            return None
        detail = "; ".join(f"{k}: {self_name}={a!r} {other_name}={b!r}" for k, (a, b) in mismatches.items())
        return LayoutMismatchError(f"KV layout mismatch ({detail})", mismatches)


@dataclass(frozen=True)
class TransferResult:
    transfer_id: str
    nbytes: int  # KV payload only (headers and acks excluded)
    seconds: float  # sender: first enqueue to last ack; receiver: first layer arrival to last layer in place
    num_layers: int

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
    name: str = "local"  # "ucx" | "nccl" | "local"
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

    def max_message_blocks(self, layout: KVLayout) -> int:
        return max(1, self.max_message_bytes // layout.block_nbytes)


class KVConnector(ABC):
    """One connector per node plays both roles: it sends to peers and receives into its own cache."""

    name: str = "base"

    def __init__(self, config: ConnectorConfig):
        from kv_transfer._book import TransferBook  # the book needs the error types defined above

        self.config = config
        self.metrics = ConnectorMetrics()
        self._layout: KVLayout | None = None
        self._caches: list[torch.Tensor] = []
        self._sent = TransferBook("send", self.metrics)
        self._received = TransferBook("recv", self.metrics)

    # -- set-up ----------------------------------------------------------------------------------------
    def register_kv_caches(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        _validate_caches(layout, kv_caches)
        self._layout, self._caches = layout, list(kv_caches)

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError(f"{self.name} connector: register_kv_caches() first")
        return self._layout

    @property
    @abstractmethod
    def address(self) -> str:
        """What the receiver advertises (registry: KV transfer address) so that senders can reach it."""

    def connect(self, peer: str, timeout: float | None = None) -> None:  # noqa: B027 - optional eager hook
        """Handshake with a peer now instead of at its first transfer (e.g. to fail fast at start-up)."""

    # -- sender side -----------------------------------------------------------------------------------
    @abstractmethod
    def send_blocks(
        self, peer: str, transfer_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> None:
        """Enqueue one layer's K and V of src blocks for peer's dst blocks; returns at once.

        Call it as soon as the layer's KV is written (on CUDA: enqueued on the current stream; the connector
        waits for it). The src blocks may be read in place until wait() returns, so keep them unchanged.
        """

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        """Block until the receiver acknowledged every layer; raises TransferError on failure or timeout."""
        return self._sent.wait(transfer_id, self._timeout(timeout))

    # -- receiver side ---------------------------------------------------------------------------------
    def expect(self, transfer_id: str, dst_block_ids: list[int], num_layers: int | None = None) -> None:
        """Accept a transfer into these (reserved) blocks; anything else a sender writes is refused."""
        layers = self.layout.num_layers if num_layers is None else num_layers
        self._check_block_ids(dst_block_ids)
        self._received.open(transfer_id, layers, allowed_dst=frozenset(dst_block_ids))

    def wait_received(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        """Block until every layer of an expected transfer is in place in this node's cache."""
        return self._received.wait(transfer_id, self._timeout(timeout))

    @abstractmethod
    def close(self) -> None:
        """Release listeners, connections and threads; pending transfers fail."""

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for implementations -------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        return self.config.transfer_timeout if timeout is None else timeout

    def _check_block_ids(self, block_ids: list[int]) -> None:
        n = self.layout.num_blocks
        if any(not 0 <= b < n for b in block_ids):
            raise ValueError(f"block ids out of range [0, {n}): {block_ids}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"duplicate block ids: {block_ids}")

    def _check_send_args(self, transfer_id: str, layer: int, src: list[int], dst: list[int]) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} src blocks but {len(dst)} dst blocks")
        self._check_block_ids(src)
        if len(set(dst)) != len(dst):
            raise ValueError(f"duplicate dst block ids: {dst}")


def _validate_caches(layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"layout has {layout.num_layers} layers but {len(kv_caches)} caches were given")
    for i, cache in enumerate(kv_caches):
        if tuple(cache.shape) != layout.cache_shape() or cache.dtype != layout.torch_dtype:
            raise ValueError(
                f"layer {i} cache is {tuple(cache.shape)} {cache.dtype}, "
                f"layout says {layout.cache_shape()} {layout.torch_dtype}"
            )
        # Contiguity is what lets a run of blocks be sent or received in place without staging.
        if not cache.is_contiguous():
            raise ValueError(f"layer {i} cache is not contiguous")
        if cache.device != kv_caches[0].device:
            raise ValueError("all layer caches must live on one device")
