"""In-process connector: peers found in a registry dict, blocks moved by direct tensor copies. Tests use it, and so
does a colocated node, which exchanges KV with no other process: it starts no thread and allocates nothing."""

from __future__ import annotations

import itertools
import logging
import os
import threading

import torch

from kvrelay.kv_transfer import _blocks
from kvrelay.kv_transfer._book import TransferBooks
from kvrelay.kv_transfer.base import KVConnector
from kvrelay.kv_transfer.types import ConnectorConfig, LayoutMismatchError, TransferError, layout_mismatch

logger = logging.getLogger(__name__)

_registry: dict[str, LocalConnector] = {}
_registry_lock = threading.Lock()
_ids = itertools.count()


class LocalConnector(KVConnector):
    name = "local"

    def __init__(self, config: ConnectorConfig, books: TransferBooks | None = None):
        super().__init__(config, books)
        self._address = f"local://{os.getpid()}-{next(_ids)}"
        self._handshaken: set[str] = set()
        self._closed = False
        with _registry_lock:
            _registry[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    def connect(self, peer: str, timeout: float | None = None) -> None:
        self._handshake(peer, transfer_id=None)

    def send_blocks(
        self, peer: str, transfer_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> None:
        self._check_send_args(transfer_id, layer, src_block_ids, dst_block_ids)
        if not self._sent.enqueue_layer(transfer_id, self.layout.num_layers, layer, peer):
            return
        try:
            target = self._handshake(peer, transfer_id)
            nbytes = target._accept(transfer_id, layer, self._caches[layer], src_block_ids, dst_block_ids)
        except TransferError as e:
            self._sent.fail(transfer_id, e)
            return
        self._sent.layer_done(transfer_id, layer, nbytes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _registry_lock:
            _registry.pop(self._address, None)
        error = TransferError(f"local connector {self._address} closed")
        self._sent.fail_all(error)
        self._received.fail_all(error)

    # -- internals -------------------------------------------------------------------------------------
    def _handshake(self, peer: str, transfer_id: str | None) -> LocalConnector:
        with _registry_lock:
            target = _registry.get(peer)
        if target is None:
            raise TransferError(f"local peer {peer} is unreachable (no such connector in this process)")
        if peer in self._handshaken:
            return target
        refusal = layout_mismatch(self.layout, target.layout, "sender", "receiver")
        if refusal is not None:
            # Both sides learn of it: the receiver fails the transfer that tried, as a wire connector would.
            seen_by_receiver = layout_mismatch(target.layout, self.layout, "receiver", "sender")
            target._refuse(
                f"refused sender {self._address}: {seen_by_receiver}", refusal.mismatches, transfer_id
            )
            self.metrics.add(refused_handshakes=1)
            raise LayoutMismatchError(f"refused by receiver {peer}: {refusal}", refusal.mismatches)
        self._handshaken.add(peer)
        return target

    def _refuse(self, message: str, mismatches: dict, transfer_id: str | None) -> None:
        logger.error("%s", message)
        self.metrics.add(refused_handshakes=1)
        if transfer_id is not None:
            self._received.fail(transfer_id, LayoutMismatchError(message, mismatches))

    def _accept(
        self, transfer_id: str, layer: int, src_cache: torch.Tensor, src_ids: list[int], dst_ids: list[int]
    ) -> int:
        with self._received.admitting(transfer_id, layer, dst_ids) as refusal:
            if refusal is None:
                data = _blocks.gather(src_cache, src_ids, _blocks.BOTH).to(self._caches[layer].device)
                _blocks.scatter(self._caches[layer], dst_ids, _blocks.BOTH, data)
                _blocks.sync_device(data)
                nbytes = data.numel() * data.element_size()
                self._received.layer_done(transfer_id, layer, nbytes)
                return nbytes
        self._received.fail(transfer_id, TransferError(refusal))
        raise TransferError(f"receiver {self._address} refused: {refusal}")
