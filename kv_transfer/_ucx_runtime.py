"""The process-wide UCX runtime: one asyncio loop thread driving ucxx for every UCX connector of the process.

ucxx keeps a single context and worker per process, so the transport list (UCX_TLS) is a process-wide choice
as well: connectors asking for different transports cannot coexist, but once the last connector is closed the
runtime resets UCX and the next one may choose again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any

from kvrelay.kv_transfer.types import ConnectorConfig, TransferError

# UCX warns that ucxx's own UCX_MEMTYPE_CACHE setting is unused on builds without CUDA: noise, not news.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx  # noqa: E402

logger = logging.getLogger(__name__)

# UCX_TLS per transport name. shm keeps tcp because the listener handshake (sockaddr) needs it.
TRANSPORTS: dict[str, str | None] = {"tcp": "tcp", "shm": "sm,tcp", "auto": None}


def ucx_settings(config: ConnectorConfig) -> tuple[str | None, bool]:
    """(UCX_TLS value or None for UCX's choice, error handling on data endpoints)."""
    if config.transport not in TRANSPORTS:
        raise ValueError(f"unknown ucx transport {config.transport!r}; choose from {sorted(TRANSPORTS)}")
    tls = config.ucx_tls or TRANSPORTS[config.transport]
    # UCX removes shared-memory lanes from endpoints with peer error handling, so shm must run without it.
    error_handling = config.error_handling if config.error_handling is not None else config.transport != "shm"
    return tls, error_handling


class UcxRuntime:
    _lock = threading.Lock()
    _current: UcxRuntime | None = None

    @classmethod
    def acquire(cls, tls: str | None, timeout: float) -> UcxRuntime:
        with cls._lock:
            runtime = cls._current
            if runtime is None:
                runtime = UcxRuntime(tls, timeout)
                cls._current = runtime
            elif runtime.tls != tls:
                raise TransferError(
                    f"UCX already runs in this process with UCX_TLS={runtime.tls!r}; cannot also use {tls!r} "
                    "(one transport per process; close the other UCX connectors first)"
                )
            runtime._users += 1
            return runtime

    def release(self) -> None:
        with UcxRuntime._lock:
            self._users -= 1
            if self._users > 0:
                return
            UcxRuntime._current = None
        self._shutdown()

    def __init__(self, tls: str | None, timeout: float):
        self.tls = tls
        self._users = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvrelay-ucx", daemon=True)
        self._thread.start()
        try:
            self.worker_address: bytes = self.run(self._init(), timeout)
        except BaseException:
            self._stop_loop()
            raise

    async def _init(self) -> bytes:
        # Initialised on the loop thread: ucxx binds its progress machinery to the running loop.
        try:
            # Python futures: without them ucxx polls each pending request with sleep(0) under the GIL, which
            # slows a transfer by orders of magnitude and keeps an idle node busy.
            ucxx.init(options={"TLS": self.tls} if self.tls else {}, enable_python_future=True)
        except RuntimeError:
            logger.warning("UCX was initialised elsewhere in this process; UCX_TLS=%s not applied", self.tls)
        logger.info("UCX %s up, UCX_TLS=%s", ucxx.__ucx_version__, self.tls or "(UCX default)")
        return bytes(ucxx.get_worker_address())

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TransferError(f"UCX operation timed out after {timeout:.1f}s") from None

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def _shutdown(self) -> None:
        try:
            self.run(self._reset(), timeout=10)
        except TransferError as e:
            logger.warning("UCX reset: %s", e)
        self._stop_loop()

    async def _reset(self) -> None:
        await asyncio.sleep(0)  # let cancelled tasks unwind so they drop their endpoints
        ctx = getattr(ucxx.core, "_ctx", None)
        if ctx is not None and getattr(ctx, "notifier_thread", None) is not None:
            # Wake the notifier thread now: it looks for its stop message once a second, and reset() joins it.
            ctx.worker.stop_request_notifier_thread()
        del ctx  # reset() refuses while anything but ucxx holds the context
        try:
            ucxx.reset()
        except Exception as e:  # noqa: BLE001 - a lingering reference only costs the chance to re-init
            logger.warning("UCX could not be reset (another transport cannot be chosen later): %s", e)

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


# -- wire helpers shared by both sides ---------------------------------------------------------------


def parse_peer(peer: str) -> tuple[str, int]:
    host, _, port = peer.removeprefix("ucx://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad ucx peer address {peer!r}; expected ucx://host:port")
    return host, int(port)


def tag(conn_id: int, seq: int) -> int:
    return (conn_id << 32) | (seq & 0xFFFFFFFF)


async def send_msg(ep: object, msg: dict) -> None:
    await ep.send_obj(json.dumps(msg).encode())


async def recv_msg(ep: object) -> dict:
    return json.loads(bytes(await ep.recv_obj()))
