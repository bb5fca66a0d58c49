"""A second node in a child process, for tests and benchmarks: it hosts connectors driven over a pipe.

The child is started with the "spawn" method so that it shares no UCX, gloo or thread state with its parent,
exactly as a decode node on another machine would not. Every call has a deadline and close() always reaps.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from dataclasses import asdict
from typing import Any

import torch

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer.base import KVAllocator, KVConnector
from kvrelay.kv_transfer.types import ConnectorConfig, torch_dtype

logger = logging.getLogger(__name__)


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


class PeerProcess:
    def __init__(self, log_level: int = logging.WARNING):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main, args=(child, log_level), name="kvrelay-peer", daemon=True
        )
        self._proc.start()
        child.close()

    def call(self, op: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((op, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer process gave no answer to {op!r} within {timeout:.0f}s")
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def create(
        self,
        key: str,
        name: str,
        config: ConnectorConfig,
        layout: KVLayout,
        seed: int | None,
        device: str = "cpu",
    ) -> str:
        """Start a connector with caches from seed in the child; returns its address."""
        return self.call("create", key, name, asdict(config), layout.to_dict(), seed, device, timeout=120)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def kill(self) -> None:
        """Die abruptly, as a crashed node would."""
        self._proc.kill()
        self._proc.join(timeout=10)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self.call("exit", timeout=15)
            except (OSError, EOFError, TimeoutError) as e:
                logger.warning("peer process did not exit cleanly: %r", e)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- child side ------------------------------------------------------------------------------------------


def _child_main(conn: Any, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="peer %(process)d %(name)s %(levelname)s: %(message)s")
    host = _Host()
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            op, args = "exit", ()
        try:
            result = getattr(host, f"op_{op}")(*args)
            conn.send((True, result))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the parent, which raises it
            conn.send((False, e))
        if op == "exit":
            return


class _Host:
    def __init__(self) -> None:
        self.connectors: dict[str, KVConnector] = {}

    def op_create(
        self, key: str, name: str, config: dict, layout: dict, seed: int | None, device: str
    ) -> str:
        from kvrelay.kv_transfer import create_connector

        connector = create_connector(name, ConnectorConfig(**config))
        kv_layout = KVLayout.from_dict(layout)
        caches = make_caches(kv_layout, seed, device, connector.kv_allocator())
        connector.register_kv_caches(kv_layout, caches)
        self.connectors[key] = connector
        return connector.address

    def op_connect(self, key: str, peer: str, timeout: float) -> None:
        self.connectors[key].connect(peer, timeout)

    def op_expect(self, key: str, transfer_id: str, dst: list[int], num_layers: int | None = None) -> None:
        self.connectors[key].expect(transfer_id, dst, num_layers)

    def op_send(
        self, key: str, peer: str, transfer_id: str, src: list[int], dst: list[int], layers: list[int] | None = None
    ) -> None:
        connector = self.connectors[key]
        for layer in range(connector.layout.num_layers) if layers is None else layers:
            connector.send_blocks(peer, transfer_id, layer, src, dst)

    def op_wait(self, key: str, transfer_id: str, timeout: float) -> Any:
        return self.connectors[key].wait(transfer_id, timeout)

    def op_wait_received(self, key: str, transfer_id: str, timeout: float) -> Any:
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

    def op_caches(self, key: str) -> list[torch.Tensor]:
        return [c.cpu() for c in self.connectors[key]._caches]

    def op_metrics(self, key: str) -> dict[str, float]:
        return self.connectors[key].metrics.snapshot()

    def op_close(self, key: str) -> None:
        self.connectors.pop(key).close()

    def op_exit(self) -> None:
        for key in list(self.connectors):
            self.op_close(key)
