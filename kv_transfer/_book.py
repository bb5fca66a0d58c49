"""Thread-safe bookkeeping of transfers in one direction: which layers are done, bytes, errors, waiters."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvrelay.kv_transfer.types import ConnectorMetrics, TransferError, TransferResult

logger = logging.getLogger(__name__)

# Failures recorded for transfers nobody waits on yet (e.g. a refused handshake before expect()); bounded so
# that a misbehaving peer cannot grow memory without limit.
_MAX_ORPHAN_FAILURES = 1024


@dataclass
class _Transfer:
    transfer_id: str
    num_layers: int
    peer: str | None = None
    allowed_dst: frozenset[int] | None = None
    enqueued: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    nbytes: int = 0
    started: float | None = None
    all_enqueued: float | None = None  # sender: when the last layer was handed over
    finished: float | None = None
    error: TransferError | None = None
    waited: bool = False  # one waiter per transfer: its answer closes the record


@dataclass(frozen=True)
class TransferBooks:
    """A connector's bookkeeping: its counters and its books of sent and received transfers. A composite
    connector (auto) hands one TransferBooks to the connectors it is made of, so that a transfer expected
    on it may arrive through any of them and waits see them all."""

    metrics: ConnectorMetrics
    sent: TransferBook
    received: TransferBook

    @classmethod
    def new(cls) -> TransferBooks:
        metrics = ConnectorMetrics()
        return cls(metrics, TransferBook("send", metrics), TransferBook("recv", metrics))


class TransferBook:
    def __init__(self, direction: str, metrics: ConnectorMetrics):
        assert direction in ("send", "recv")
        self._direction = direction
        self._metrics = metrics
        self._cond = threading.Condition()
        self._transfers: dict[str, _Transfer] = {}
        self._orphans: OrderedDict[str, TransferError] = OrderedDict()
        # Receiver: transfer id -> layers check_layer let in that may still be writing into the cache. Kept
        # apart from the records, which a wait removes while such a write can still be under way.
        self._landing: dict[str, int] = {}

    # -- opening ---------------------------------------------------------------------------------------
    def open(self, transfer_id: str, num_layers: int, allowed_dst: frozenset[int] | None = None) -> None:
        with self._cond:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already open")
            t = _Transfer(transfer_id, num_layers, allowed_dst=allowed_dst)
            t.error = self._orphans.pop(transfer_id, None)
            self._transfers[transfer_id] = t

    def enqueue_layer(self, transfer_id: str, num_layers: int, layer: int, peer: str) -> bool:
        """Sender: note a layer as enqueued (opening the transfer at its first). False: already failed."""
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None:
                t = self._transfers[transfer_id] = _Transfer(transfer_id, num_layers, peer=peer)
            if t.peer != peer:
                raise ValueError(f"transfer {transfer_id!r} goes to {t.peer}, not {peer}")
            if layer in t.enqueued:
                raise ValueError(f"transfer {transfer_id!r}: layer {layer} was already sent")
            t.enqueued.add(layer)
            now = time.perf_counter()
            if t.started is None:
                t.started = now
            if len(t.enqueued) == t.num_layers:
                t.all_enqueued = now
            return t.error is None

    # -- progress --------------------------------------------------------------------------------------
    def check_layer(self, transfer_id: str, layer: int, dst_block_ids: list[int]) -> str | None:
        """Receiver: why this layer must be refused, or None if it may be written; then the caller writes it
        and calls landed() once the write is over, whatever its outcome."""
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None:
                return (
                    f"transfer {transfer_id!r} is not expected by the receiver (never reserved, or expired)"
                )
            if t.error is not None:
                return f"transfer {transfer_id!r} already failed: {t.error}"
            if not 0 <= layer < t.num_layers or layer in t.done:
                return f"transfer {transfer_id!r}: unexpected or repeated layer {layer}"
            if t.allowed_dst is not None and not t.allowed_dst.issuperset(dst_block_ids):
                extra = sorted(set(dst_block_ids) - t.allowed_dst)
                return f"transfer {transfer_id!r}: dst blocks {extra} were not reserved for it"
            if t.started is None:
                t.started = time.perf_counter()
            self._landing[transfer_id] = self._landing.get(transfer_id, 0) + 1
            return None

    @contextmanager
    def admitting(self, transfer_id: str, layer: int, dst_block_ids: list[int]) -> Iterator[str | None]:
        """Receiver: check_layer's answer; a layer let in counts as landing until the block exits."""
        refusal = self.check_layer(transfer_id, layer, dst_block_ids)
        try:
            yield refusal
        finally:
            if refusal is None:
                self.landed(transfer_id)

    def landed(self, transfer_id: str) -> None:
        """Receiver: a layer that check_layer let in no longer writes into the cache."""
        with self._cond:
            left = self._landing[transfer_id] - 1
            if left:
                self._landing[transfer_id] = left
            else:
                del self._landing[transfer_id]
                self._cond.notify_all()

    def wait_landed(self, transfer_id: str, timeout: float) -> bool:
        """Receiver: block until no layer of the transfer is being written into the cache (so that its blocks
        may be freed); False if one still was after timeout seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: transfer_id not in self._landing, timeout)

    def layer_done(self, transfer_id: str, layer: int, nbytes: int) -> None:
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None or t.error is not None:
                return  # timed out or failed meanwhile: its waiter has already been answered
            t.done.add(layer)
            t.nbytes += nbytes
            if len(t.done) == t.num_layers:
                t.finished = time.perf_counter()
                self._cond.notify_all()

    def fail(self, transfer_id: str, error: TransferError) -> None:
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None:
                # A sender's transfer is unknown only once wait() has answered; a receiver may hear of a
                # failure (a refused handshake) before expect(): keep it for then.
                if self._direction == "send" or transfer_id in self._orphans:
                    return
                self._orphans[transfer_id] = error
                while len(self._orphans) > _MAX_ORPHAN_FAILURES:
                    self._orphans.popitem(last=False)
            elif t.error is None and t.finished is None:
                t.error = error
                self._cond.notify_all()
            else:
                return  # the first error stands; later ones are consequences
        logger.warning("%s transfer %s failed: %s", self._direction, transfer_id, error)

    def fail_unfinished(self, transfer_id: str, error: TransferError) -> None:
        """Fail a transfer only if it is still open (no record is kept for one already answered)."""
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None or t.error is not None or t.finished is not None:
                return
        self.fail(transfer_id, error)

    def fail_peer(self, peer: str, error: TransferError) -> None:
        """Sender: fail every unfinished transfer to a peer whose connection broke."""
        with self._cond:
            ids = [t.transfer_id for t in self._transfers.values() if t.peer == peer]
        for transfer_id in ids:
            self.fail(transfer_id, error)

    def fail_all(self, error: TransferError) -> None:
        with self._cond:
            ids = list(self._transfers)
        for transfer_id in ids:
            self.fail(transfer_id, error)

    def peer_of(self, transfer_id: str) -> str | None:
        with self._cond:
            t = self._transfers.get(transfer_id)
            return None if t is None else t.peer

    def error_of(self, transfer_id: str) -> TransferError | None:
        with self._cond:
            t = self._transfers.get(transfer_id)
            return None if t is None else t.error

    # -- waiting ---------------------------------------------------------------------------------------
    def wait(self, transfer_id: str, timeout: float) -> TransferResult:
        deadline = time.monotonic() + timeout
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None:
                orphan = self._orphans.pop(transfer_id, None)
                if orphan is not None:
                    self._metrics.add(failures=1)
                    raise orphan
                raise TransferError(f"unknown transfer {transfer_id!r} ({self._direction} side)")
            if t.waited:
                raise RuntimeError(f"{self._direction} transfer {transfer_id!r} already has a waiter")
            t.waited = True
            while t.error is None and t.finished is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    t.error = TransferError(
                        f"{self._direction} transfer {transfer_id!r} timed out after {timeout:.1f}s "
                        f"({len(t.done)}/{t.num_layers} layers done)"
                    )
                    break
                self._cond.wait(left)
            del self._transfers[transfer_id]
        return self._settle(t)

    def _settle(self, t: _Transfer) -> TransferResult:
        if t.error is not None:
            self._metrics.add(failures=1)
            raise t.error
        seconds = t.finished - t.started if t.started is not None and t.finished is not None else 0.0
        if self._direction == "send":
            self._metrics.add(bytes_sent=t.nbytes, transfers_sent=1, send_seconds=seconds)
        else:
            self._metrics.add(bytes_received=t.nbytes, transfers_received=1, recv_seconds=seconds)
        tail = t.finished - t.all_enqueued if t.all_enqueued is not None and t.finished is not None else 0.0
        return TransferResult(t.transfer_id, t.nbytes, seconds, t.num_layers, last_layer_seconds=tail)
