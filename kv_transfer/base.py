"""The KV transfer interface: move given blocks of every layer from a prefill cache into a decode cache.

Sender side (prefill): `send_blocks` once per layer as soon as that layer's KV is written; it only enqueues,
so the wire transfer of layer L overlaps the compute of layer L+1. `wait` then blocks until the receiver has
acknowledged every layer. Receiver side (decode): `expect` names the reserved destination blocks (a sender may
write nowhere else) and `wait_received` blocks until every layer is in place, after which the request can be
admitted. Before the first transfer between two connectors they exchange `KVLayout`s and refuse a mismatch.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from kvrelay.common.kv_allocator import KVAllocator
from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer._book import TransferBooks
from kvrelay.kv_transfer.types import ConnectorConfig, TransferError, TransferResult, torch_dtype

if TYPE_CHECKING:  # annotations only: importing the package must not import torch
    import torch

logger = logging.getLogger(__name__)

# How long past transfer_timeout a freed transfer waits for a layer still being written into its blocks.
_SETTLE_GRACE_S = 5.0
_CHECKED_TRANSFERS = 64  # transfers whose block lists a sender remembers as checked


class KVConnector(ABC):
    """One connector per node plays both roles: it sends to peers and receives into its own cache."""

    name: str = "base"

    def __init__(self, config: ConnectorConfig, books: TransferBooks | None = None):
        self.config = config
        self.books = books if books is not None else TransferBooks.new()
        self.metrics = self.books.metrics
        self._layout: KVLayout | None = None
        self._caches: list[torch.Tensor] = []
        self._sent = self.books.sent
        self._received = self.books.received
        self._checked: dict[str, tuple[list[int], list[int]]] = {}  # the blocks of the last transfers sent

    # -- set-up ----------------------------------------------------------------------------------------
    def kv_allocator(self) -> KVAllocator | None:
        """Where the engine must allocate its KV caches for this connector to share them with peers (the
        engine takes it at construction), or None: anywhere (plain tensors)."""
        return None

    def register_kv_caches(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        _validate_caches(layout, kv_caches)
        self._layout, self._caches = layout, list(kv_caches)

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError(f"{self.name} connector: register_kv_caches() first")
        return self._layout

    @property
    def registered_layout(self) -> KVLayout | None:
        """The layout once register_kv_caches() was called, else None (a receiver then refuses senders)."""
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
        peer = self._sent.peer_of(transfer_id)
        try:
            return self._sent.wait(transfer_id, self._timeout(timeout))
        except TransferError as e:
            if peer is not None:  # let the receiver give up now rather than at its own deadline
                self._abort_remote(peer, transfer_id, str(e))
            raise

    def _abort_remote(self, peer: str, transfer_id: str, reason: str) -> None:  # noqa: B027 - optional hook
        """Tell the receiver that a failed transfer is over (a wire connector posts an abort to its peer)."""

    # -- receiver side ---------------------------------------------------------------------------------
    def expect(self, transfer_id: str, dst_block_ids: list[int], num_layers: int | None = None) -> None:
        """Accept a transfer into these (reserved) blocks; anything else a sender writes is refused."""
        layers = self.layout.num_layers if num_layers is None else num_layers
        self._check_block_ids(dst_block_ids)
        self._received.open(transfer_id, layers, allowed_dst=frozenset(dst_block_ids))

    def wait_received(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        """Block until every layer of an expected transfer is in place in this node's cache. Once it returns
        or raises, no layer of the transfer writes into the cache any more."""
        try:
            return self._received.wait(transfer_id, self._timeout(timeout))
        finally:
            self._settle(transfer_id)

    def abandon_received(self, transfer_id: str) -> None:
        """Refuse the rest of an expected transfer (its blocks are about to be freed): its waiter answers at
        once with TransferError, and layers that come later are refused. Returns once no layer that was
        already let in still writes into the blocks."""
        self._received.fail_unfinished(transfer_id, TransferError(f"transfer {transfer_id!r} was abandoned "
                                                                  "by the receiver (its request left)"))
        self._settle(transfer_id)

    def _settle(self, transfer_id: str) -> None:
        # The caller frees the transfer's blocks next. A layer's receive is bounded by transfer_timeout (the
        # connectors drop the connection when one overruns), so this wait is too.
        limit = self.config.transfer_timeout + _SETTLE_GRACE_S
        if not self._received.wait_landed(transfer_id, limit):
            logger.error("transfer %s: a layer was still being received %.0f s after the transfer ended; its "
                         "blocks are released anyway", transfer_id, limit)

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
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= n):
            raise ValueError(f"block ids out of range [0, {n}): {block_ids}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"duplicate block ids: {block_ids}")

    def _check_send_args(self, transfer_id: str, layer: int, src: list[int], dst: list[int]) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        # Every layer of a transfer names the same blocks: checked once (a comparison costs far less than a check).
        if self._checked.get(transfer_id) == (src, dst):
            return
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} src blocks but {len(dst)} dst blocks")
        self._check_block_ids(src)
        if len(set(dst)) != len(dst):
            raise ValueError(f"duplicate dst block ids: {dst}")
        self._checked[transfer_id] = (list(src), list(dst))
        while len(self._checked) > _CHECKED_TRANSFERS:
            del self._checked[next(iter(self._checked))]


def _validate_caches(layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"layout has {layout.num_layers} layers but {len(kv_caches)} caches were given")
    for i, cache in enumerate(kv_caches):
        if tuple(cache.shape) != layout.cache_shape() or cache.dtype != torch_dtype(layout):
            raise ValueError(
                f"layer {i} cache is {tuple(cache.shape)} {cache.dtype}, "
                f"layout says {layout.cache_shape()} {torch_dtype(layout)}"
            )
        # Contiguity is what lets a run of blocks be sent or received in place without staging.
        if not cache.is_contiguous():
            raise ValueError(f"layer {i} cache is not contiguous")
        if cache.device != kv_caches[0].device:
            raise ValueError("all layer caches must live on one device")
