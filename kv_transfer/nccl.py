"""torch.distributed point-to-point connector: NCCL for CUDA caches, gloo for CPU caches, the same code.

Each receiver hosts a TCPStore (its advertised address). A sender joins it, takes the next pair number, and
both sides build a private 2-rank process group (sender rank 0, receiver rank 1) on a prefixed view of the
store, so one node can pair with any number of peers without a global default group. Control messages
(handshake, one JSON header per layer, acks) travel through store queues; block bytes go by isend/irecv,
posted in the same order on both sides (NCCL matches point-to-point operations by order, gloo also by tag).

A NCCL pair needs the two ranks on different GPUs, as in prefill/decode disaggregation.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import _blocks, _handshake
from kvrelay.kv_transfer._book import TransferBook, TransferBooks
from kvrelay.kv_transfer._wire import Job, WireCaches
from kvrelay.kv_transfer.base import KVConnector
from kvrelay.kv_transfer.types import ConnectorConfig, TransferError

logger = logging.getLogger(__name__)

_PAIRS = "kvrelay/pairs"
_IDLE_POLL = timedelta(seconds=0.5)  # how often idle threads look up to notice close()


def parse_peer(peer: str) -> tuple[str, int]:
    host, _, port = peer.partition("://")[2].rpartition(":") if "://" in peer else peer.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad nccl peer address {peer!r}; expected nccl://host:port")
    return host, int(port)


def _push(store: dist.Store, key: str, msg: dict) -> None:
    store.queue_push(key, json.dumps(msg).encode())


def _pop(store: dist.Store, key: str, closed: threading.Event) -> dict | None:
    """Next message of a queue, or None once closed. store must have a short (idle poll) timeout."""
    while not closed.is_set():
        try:
            return json.loads(store.queue_pop(key))
        except dist.DistStoreError:
            continue  # nothing yet: look at the closed flag again
    return None


def _message_tags() -> Iterator[int]:
    """Tags for data messages: both sides count them in the same order (wrapping keeps them int32)."""
    return (i % (1 << 30) for i in itertools.count())


def _finish_sends(works: list[dist.Work], release: Callable[[], None], timeout: timedelta) -> None:
    for work in works:
        work.wait(timeout)
    release()  # the staging may be reused only now


class NcclConnector(KVConnector):
    name = "nccl"

    def __init__(self, config: ConnectorConfig, books: TransferBooks | None = None):
        super().__init__(config, books)
        self._closed = threading.Event()
        self._store = dist.TCPStore(
            config.host, config.port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=config.connect_timeout),
        )
        self._port: int = self._store.port
        self._staging = _blocks.StagingPool()
        self._wire: WireCaches | None = None  # once the caches are registered
        self._peers: dict[str, _PairSender] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._start(self._accept_loop, "kvrelay-nccl-accept")

    @property
    def address(self) -> str:
        return f"nccl://{self.config.host}:{self._port}"

    @property
    def backend(self) -> str:
        return self.config.backend or ("nccl" if self._caches and self._caches[0].is_cuda else "gloo")

    def register_kv_caches(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(layout, kv_caches)
        self._wire = WireCaches(self.config, layout, tuple(kv_caches), self._staging, self._received)

    def connect(self, peer: str, timeout: float | None = None) -> None:
        sender = self._peer(peer, None)
        if not sender.connected.wait(self.config.connect_timeout + 1 if timeout is None else timeout):
            raise TransferError(f"no handshake with nccl peer {peer} in time")
        if sender.error is not None:
            raise sender.error

    def send_blocks(
        self, peer: str, transfer_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> None:
        self._check_send_args(transfer_id, layer, src_block_ids, dst_block_ids)
        parse_peer(peer)  # a malformed address is the caller's bug: raise here, not on the transfer thread
        if self._closed.is_set():
            raise TransferError("nccl connector is closed")
        if not self._sent.enqueue_layer(transfer_id, self.layout.num_layers, layer, peer):
            return
        sender = self._peer(peer, transfer_id)
        sender.jobs.put(self._wire.job(transfer_id, layer, src_block_ids, dst_block_ids))
        if sender.error is not None:  # it broke while we enqueued: nobody will take the job any more
            self._sent.fail(transfer_id, sender.error)

    def _abort_remote(self, peer: str, transfer_id: str, reason: str) -> None:
        with self._lock:
            sender = self._peers.get(peer)
        if sender is not None:
            sender.jobs.put(("abort", transfer_id, reason))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            senders = list(self._peers.values())
            self._peers.clear()
        for sender in senders:
            sender.jobs.put(None)
        deadline = time.monotonic() + 5.0
        for thread in self._threads + [s.thread for s in senders]:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        error = TransferError("nccl connector closed")
        self._sent.fail_all(error)
        self._received.fail_all(error)
        self._store = None  # the store server stops with its last reference, so peers see us gone

    # -- internals ----------------------------------------------------------------------------------------
    def _start(self, target: object, name: str, *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def _peer(self, peer: str, first_transfer_id: str | None) -> _PairSender:
        with self._lock:
            sender = self._peers.get(peer)
            if sender is None or sender.error is not None:
                if self._wire is None:
                    raise TransferError("nccl connector cannot send before register_kv_caches()")
                sender = self._peers[peer] = _PairSender(
                    peer, first_transfer_id, caches=self._wire, book=self._sent, process_group=self._process_group
                )
            return sender

    def _process_group(self, store: dist.Store, rank: int) -> dist.ProcessGroup:
        timeout = timedelta(seconds=self.config.transfer_timeout)
        if self.backend == "nccl":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise TransferError("this torch build has no NCCL; use backend gloo")
            torch.cuda.set_device(self._caches[0].device)  # per thread: the one that will use this group
            return dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
        options = dist.ProcessGroupGloo._Options()
        # Bind to the advertised interface rather than whatever the hostname resolves to.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.config.host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, 2, options)

    def _accept_loop(self) -> None:
        store = self._store.clone()
        accepted = 0
        while not self._closed.wait(0.02):
            pairs = store.add(_PAIRS, 0)
            for pair in range(accepted, pairs):
                self._start(self._serve_pair, f"kvrelay-nccl-pair{pair}", pair)
            accepted = max(accepted, pairs)

    def _serve_pair(self, pair: int) -> None:
        root = self._store
        if root is None:  # closed meanwhile
            return
        store = dist.PrefixStore(f"kvrelay/{pair}/", root.clone())
        store.set_timeout(timedelta(seconds=self.config.connect_timeout))
        seen: set[str] = set()
        try:
            pg = self._accept(store, pair)
            if pg is None:
                return
            self._serve_layers(store, pg, seen)
        except Exception as e:  # noqa: BLE001 - a broken pair fails its transfers, never the node
            logger.info("nccl pair %d ended: %r", pair, e)
            for transfer_id in seen:
                self._received.fail_unfinished(
                    transfer_id, TransferError(f"connection to sender lost: {e!r}")
                )

    def _accept(self, store: dist.Store, pair: int) -> dist.ProcessGroup | None:
        hello = json.loads(store.queue_pop("to_recv"))
        ours = self.registered_layout
        refusal = _handshake.judge(ours, KVLayout.from_dict(hello["layout"]))
        if refusal is not None:
            _push(store, "to_send", _handshake.refuse(self.books, ours, refusal, hello.get("transfer_id"),
                                                      f"nccl (pair {pair})"))
            return None
        _push(store, "to_send", _handshake.accepted(ours))
        return self._process_group(dist.PrefixStore("pg/", store), rank=1)

    def _serve_layers(self, store: dist.Store, pg: dist.ProcessGroup, seen: set[str]) -> None:
        store.set_timeout(_IDLE_POLL)
        tags = _message_tags()
        while (msg := _pop(store, "to_recv", self._closed)) is not None:
            if msg["kind"] == "bye":
                return
            if msg["kind"] == "abort":
                self._received.fail(msg["transfer_id"], TransferError(f"sender aborted: {msg['error']}"))
                continue
            seen.add(msg["transfer_id"])
            error = self._recv_layer(pg, msg, tags)
            _push(
                store, "to_send", {"transfer_id": msg["transfer_id"], "layer": msg["layer"], "error": error}
            )

    def _recv_layer(self, pg: dist.ProcessGroup, msg: dict, tags: Iterator[int]) -> str | None:
        with self._wire.landing(msg) as landing:
            works = [pg.recv([_blocks.as_bytes(buf)], 0, next(tags)) for buf in landing.buffers]
            for work in works:
                work.wait(timedelta(seconds=self.config.transfer_timeout))
        return landing.refusal


class _PairSender:
    """The sender half of one pair: a thread posting layers in order, another collecting acks."""

    def __init__(self, peer: str, first_transfer_id: str | None, *, caches: WireCaches, book: TransferBook,
                 process_group: Callable[[dist.Store, int], dist.ProcessGroup]):
        self.peer, self.config = peer, caches.config
        self._caches, self._book, self._process_group = caches, book, process_group
        self.jobs: queue.Queue[Job | tuple[str, str, str] | None] = queue.Queue()
        self.acks: queue.Queue[tuple[str, int, int] | None] = queue.Queue()
        self.connected = threading.Event()
        self.error: TransferError | None = None
        self.store: dist.Store | None = None
        self.ack_store: dist.Store | None = None
        self.thread = threading.Thread(target=self._run, args=(first_transfer_id,), daemon=True)
        self.thread.start()

    def _run(self, first_transfer_id: str | None) -> None:
        try:
            pg = self._connect(first_transfer_id)
        except TransferError as e:
            self._break(e)
            return
        finally:
            self.connected.set()
        ack_thread = threading.Thread(target=self._read_acks, daemon=True)
        ack_thread.start()
        try:
            self._send_loop(pg)
        except Exception as e:  # noqa: BLE001
            self._break(TransferError(f"sending to nccl peer {self.peer} failed: {e!r}"))
        self.acks.put(None)
        ack_thread.join(timeout=self.config.transfer_timeout)

    def _connect(self, transfer_id: str | None) -> dist.ProcessGroup:
        host, port = parse_peer(self.peer)
        layout, timeout = self._caches.layout, timedelta(seconds=self.config.connect_timeout)
        try:
            root = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
            pair = root.add(_PAIRS, 1) - 1
            self.store = dist.PrefixStore(f"kvrelay/{pair}/", root)
            # Acks are read on another thread: give it its own connection.
            self.ack_store = dist.PrefixStore(f"kvrelay/{pair}/", root.clone())
            _push(self.store, "to_recv", {"layout": layout.to_dict(), "transfer_id": transfer_id})
            reply = json.loads(self.store.queue_pop("to_send"))
        except dist.DistError as e:
            first_line = str(e).splitlines()[0] if str(e) else repr(e)
            raise TransferError(
                f"cannot connect to nccl peer {self.peer} within {timeout.total_seconds():.1f}s: {first_line}"
            ) from None
        _handshake.check_reply(reply, layout, self.peer)
        return self._process_group(dist.PrefixStore("pg/", self.store), 0)

    def _send_loop(self, pg: dist.ProcessGroup) -> None:
        tags = _message_tags()
        inflight: deque[tuple[list[dist.Work], Callable[[], None]]] = deque()
        timeout = timedelta(seconds=self.config.transfer_timeout)
        while (job := self.jobs.get()) is not None:
            if isinstance(job, tuple):
                _push(self.store, "to_recv", {"kind": "abort", "transfer_id": job[1], "error": job[2]})
                continue
            if self._book.error_of(job.transfer_id) is not None:
                continue  # already failed: spare the wire
            if job.ready is not None:
                job.ready.synchronize()  # the layer's kernels were only enqueued when send_blocks ran
            out = self._caches.outgoing(job)
            _push(self.store, "to_recv", out.header)
            works = [pg.send([_blocks.as_bytes(src)], 1, next(tags)) for src in out.sources]
            inflight.append((works, out.release))
            self.acks.put((job.transfer_id, job.layer, out.nbytes))
            while len(inflight) > self.config.max_inflight_layers:
                _finish_sends(*inflight.popleft(), timeout)
        while inflight:
            _finish_sends(*inflight.popleft(), timeout)
        _push(self.store, "to_recv", {"kind": "bye"})

    def _read_acks(self) -> None:
        store = self.ack_store
        store.set_timeout(timedelta(seconds=self.config.transfer_timeout))
        sent = self._book
        while (item := self.acks.get()) is not None:
            transfer_id, layer, nbytes = item
            try:
                ack = json.loads(store.queue_pop("to_send"))
            except dist.DistError as e:
                self._break(TransferError(f"no ack from nccl peer {self.peer}: {str(e).splitlines()[0]}"))
                return
            if (ack["transfer_id"], ack["layer"]) != (transfer_id, layer):
                self._break(TransferError(f"nccl peer {self.peer} acked out of order: {ack}"))
                return
            if ack["error"]:
                sent.fail(
                    transfer_id, TransferError(f"receiver {self.peer} refused layer {layer}: {ack['error']}")
                )
            else:
                sent.layer_done(transfer_id, layer, nbytes)

    def _break(self, error: TransferError) -> None:
        self.error = error
        self._book.fail_peer(self.peer, error)
        while not self.jobs.empty():
            job = self.jobs.get_nowait()
            if isinstance(job, Job):
                self._book.fail(job.transfer_id, error)
