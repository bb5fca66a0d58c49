"""The default connector: shared memory to peers on this host, `config.remote` (ucx) to the others.

It is made of an shm connector and a remote one that share its bookkeeping (TransferBooks): a receiver
expects a transfer once and it may arrive through either. The address names both, `auto://<shm
address>|<remote address>`; a sender picks shm when the peer's shm address carries its own place (host id:
same boot, same /dev/shm; and for CUDA caches the same GPU) and its own caches are in the shm segment, else the
remote connector. The KV caches are allocated by the shm connector: a memfd in host memory, one device
allocation on CUDA, whose IPC handle a same-GPU receiver opens (CUDA IPC: a device-to-device copy, no network
stack); peers on other GPUs or hosts go remote.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer._book import TransferBooks
from kvrelay.kv_transfer.base import KVConnector
from kvrelay.kv_transfer.shm import SCHEME as SHM_SCHEME
from kvrelay.kv_transfer.shm import ShmConnector, parse_address
from kvrelay.kv_transfer.types import ConnectorConfig, TransferResult

logger = logging.getLogger(__name__)

SCHEME = "auto://"
_SHM_DEVICES = ("cpu", "cuda")  # where the shm connector can hold the caches


def split_address(peer: str) -> dict[str, str]:
    """{scheme: address} of the parts of an auto:// address."""
    if not peer.startswith(SCHEME):
        raise ValueError(f"bad auto peer address {peer!r}; expected auto://<shm address>|<remote address>")
    parts = {}
    for part in peer.removeprefix(SCHEME).split("|"):
        scheme, sep, _ = part.partition("://")
        if not sep:
            raise ValueError(f"bad auto peer address {peer!r}: part {part!r} has no scheme")
        parts[scheme] = part
    return parts


class AutoConnector(KVConnector):
    name = "auto"

    def __init__(self, config: ConnectorConfig, books: TransferBooks | None = None):
        super().__init__(config, books)
        if config.remote not in ("ucx", "nccl"):
            raise ValueError(f"remote: {config.remote!r}; the auto connector reaches other hosts by ucx or nccl")
        from kvrelay.kv_transfer import create_connector

        self._shm = ShmConnector(config, self.books)
        try:
            self._remote = create_connector(config.remote, replace(config, name=config.remote), self.books)
        except BaseException:
            self._shm.close()
            raise
        self._routes: dict[str, tuple[KVConnector, str]] = {}
        self._shm_receives = False

    @property
    def address(self) -> str:
        if self._layout is not None and not self._shm_receives:  # caches on neither CPU nor CUDA: no shm
            return f"{SCHEME}{self._remote.address}"
        return f"{SCHEME}{self._shm.address}|{self._remote.address}"

    def kv_allocator(self) -> AutoConnector:
        return self

    def allocate_kv_caches(
        self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        if torch.device(device).type not in _SHM_DEVICES:  # no shm segment there: every peer goes remote
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return self._shm.allocate_kv_caches(num_layers, shape, dtype, device)

    def register_kv_caches(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(layout, kv_caches)
        self._remote.register_kv_caches(layout, kv_caches)
        if kv_caches[0].device.type in _SHM_DEVICES:
            self._shm.register_kv_caches(layout, kv_caches)
            self._shm_receives = True

    def route(self, peer: str) -> tuple[KVConnector, str]:
        """(the connector, its address of the peer) that a transfer to `peer` goes through."""
        found = self._routes.get(peer)
        if found is None:
            parts = split_address(peer)
            shm = parts.get(SHM_SCHEME.removesuffix("://"))
            if shm is not None and self._shm.can_send and parse_address(shm)[0] == self._shm.place:
                found = (self._shm, shm)
            elif self.config.remote in parts:
                found = (self._remote, parts[self.config.remote])
            else:
                raise ValueError(f"auto peer {peer!r} is on another host and offers no {self.config.remote} address")
            logger.info("KV transfers to %s go over %s", peer, found[0].name)
            self._routes[peer] = found
        return found

    def connect(self, peer: str, timeout: float | None = None) -> None:
        connector, address = self.route(peer)
        connector.connect(address, timeout)

    def send_blocks(
        self, peer: str, transfer_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> None:
        connector, address = self.route(peer)
        connector.send_blocks(address, transfer_id, layer, src_block_ids, dst_block_ids)

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult:
        peer = self._sent.peer_of(transfer_id)  # the part's address: its scheme names the connector
        connector = self._shm if peer is not None and peer.startswith(SHM_SCHEME) else self._remote
        return connector.wait(transfer_id, timeout)

    def close(self) -> None:
        self._shm.close()
        self._remote.close()
