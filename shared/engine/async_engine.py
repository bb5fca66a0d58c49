"""AsyncEngine: an EngineCore driven by one dedicated thread, behind an asyncio API for the node servers.

The engine is not thread-safe, so everything that touches it runs on that thread.

Lifecycle:
1. `start()` (inside the running event loop) starts the engine thread.
2. Callers submit commands (functions of the EngineCore) to a queue; the thread runs them between steps
   and resolves each caller's future on the event loop (call_soon_threadsafe).
3. While requests are unfinished the thread steps; each step's outputs go to their requests' asyncio
   queues in a single loop callback. With no work it sleeps on the command queue for `idle_poll_s`, waking
   to expire leases (reservations and held blocks nobody claimed) and to grant queued reservations the
   blocks that came free (their callers wait on futures meanwhile).
4. After every iteration it refreshes the load and the observer's metrics, and hands the prefix cache's
   block events to the `block_events` sink (a node's index publisher), or a snapshot of every cached
   block instead when the sink asks for one (it lost track: Redis restarted, a lease lapsed).
5. `shutdown(timeout)` stops taking new work (EngineDraining), lets in-flight requests and leases finish
   within the timeout, aborts whatever is left and stops the thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from kvrelay.common.records import ImageInput, NodeLoad
from kvrelay.common.sampling_params import BeamSearchParams, SamplingParams
from kvrelay.engine.core import EngineCore
from kvrelay.engine.engine_hooks import EngineDead, EngineDraining, EngineHooks
from kvrelay.engine.request import KVSendSpec
from kvrelay.engine.scheduler_output import EngineCoreOutput, Reservation

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Stream:
    """Where one engine request's outputs go; owned by the engine thread."""

    queue: asyncio.Queue
    arrival: float  # monotonic
    computes_prompt: bool  # TTFT and prompt tokens count on this node
    parent: str | None = None  # n > 1: the client's request id
    last_token_at: float | None = None


class AsyncEngine:
    def __init__(self, core: EngineCore, hooks: EngineHooks | None = None, idle_poll_s: float = 0.05) -> None:
        self.core = core
        hooks = hooks or EngineHooks()
        self.metrics = hooks.observer
        self._block_events = hooks.block_events
        if hooks.tier_events:
            core.publish_tiers(hooks.tier_events)
        self._on_lease_expired = hooks.on_lease_expired
        self.idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._children: dict[str, set[str]] = {}  # n > 1: parent id -> unfinished child ids
        # Queued reservations: id -> (the caller's future, its on_reserved hook); engine thread only.
        self._reserve_waiters: dict[str, tuple[asyncio.Future, Callable | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="kvrelay-engine", daemon=True)
        self._stop = False
        self._draining = False
        self._load = core.load()

    # -- control --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def load(self) -> NodeLoad:
        return self._load

    def stop_accepting(self) -> None:
        self._draining = True

    async def shutdown(self, timeout: float) -> None:
        """Stop taking work; wait up to `timeout` for in-flight requests and leases; abort the rest."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._load.busy and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        if self._thread.is_alive():
            left = await self.call(self._abort_everything)
            if left:
                logger.warning("shutdown: aborted %d requests still in flight after %.1fs", left, timeout)
            self._stop = True
            self._commands.put(None)
            await asyncio.to_thread(self._thread.join, 10.0)

    # -- requests -------------------------------------------------------------------------------------
    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run fn(core) on the engine thread between steps and return its result (or raise its error)."""
        if not self._thread.is_alive():
            raise EngineDead("the engine thread is not running")
        future = self._loop.create_future()
        self._commands.put((fn, future))
        return await future

    async def generate(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, cache_salt: str = "",
        arrival: float | None = None, kv_send: KVSendSpec | None = None, beam_search: BeamSearchParams | None = None,
        lora_name: str = "", images: Sequence[ImageInput] = (),
    ) -> AsyncIterator[EngineCoreOutput]:
        """Stream a request's outputs (n > 1: the children's, interleaved, by child id; beam_search: one
        output at the end, with the beams). Leaving the loop early aborts what is unfinished. Raises
        ValueError for a bad request, UnknownAdapter for an adapter the engine does not know, EngineDraining
        when closing."""
        self._check_accepting()
        q: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic() if arrival is None else arrival
        await self._grammar_compiled(params)

        def add(core: EngineCore) -> list[str]:
            if beam_search is not None:
                if images:
                    raise ValueError("beam_search: not with images")
                core.add_beam_search(request_id, prompt, beam_search, arrival, cache_salt, lora_name)
                ids = [request_id]
            else:
                ids = core.add_request(request_id, prompt, params, arrival, cache_salt, kv_send, lora_name, images)
            parent = request_id if len(ids) > 1 else None
            for rid in ids:
                self._streams[rid] = _Stream(q, arrival, computes_prompt=True, parent=parent)
            if parent is not None:
                self._children[parent] = set(ids)
            return ids

        ids = await self._call_or_abort(add, request_id)
        async with aclosing(self._drain_stream(q, ids)) as stream:
            async for out in stream:
                yield out

    async def prefill(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, kv_send: KVSendSpec,
        cache_salt: str = "", arrival: float | None = None, lora_name: str = "", images: Sequence[ImageInput] = (),
    ) -> EngineCoreOutput:
        """Prefill role: compute the prompt, send its KV per `kv_send`, and return the first token's output
        (finish_reason "abort" and no token when it was aborted). Its blocks stay held: release_held()."""
        async with aclosing(self.generate(request_id, prompt, params, cache_salt, arrival, kv_send,
                                          lora_name=lora_name, images=images)) as stream:
            async for out in stream:
                return out  # max_tokens is 1 for a kv_send request: the first output is the last
        raise EngineDead(f"request {request_id!r} ended without output")

    async def reserve(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, lease_s: float | None = None,
        cache_salt: str = "", on_reserved: Callable[[Reservation], None] | None = None, wait_s: float = 0.0,
        lora_name: str = "", images: Sequence[ImageInput] = (),
    ) -> Reservation | None:
        """Decode role: blocks for a prompt a prefill node will compute, or None (no room now, or none came
        free within `wait_s`: the reservation waits in the node's queue meanwhile). `on_reserved` runs on the
        engine thread right after the blocks are set aside (e.g. connector.expect); if it raises, the
        reservation is undone. QueueFull when the node's waiting requests are at their bound."""
        self._check_accepting()
        await self._grammar_compiled(params)  # a bad grammar is refused before any block is set aside
        waiter = self._loop.create_future() if wait_s > 0 else None

        def run(core: EngineCore) -> Reservation | None | asyncio.Future:
            until = time.monotonic() + wait_s if waiter is not None else None
            res = core.reserve(request_id, prompt, params, lease_s, cache_salt, queue_until=until, lora_name=lora_name,
                               images=images)
            if res is not None:
                self._reserved(core, res, on_reserved)
            elif waiter is not None and core.is_queued(request_id):
                self._reserve_waiters[request_id] = (waiter, on_reserved)
                return waiter
            return res

        result = await self._call_or_abort(run, request_id)
        if not isinstance(result, asyncio.Future):
            return result
        try:
            return await result
        except asyncio.CancelledError:
            self.abort_nowait(request_id)
            raise

    @staticmethod
    def _reserved(core: EngineCore, res: Reservation, on_reserved: Callable | None) -> None:
        if on_reserved is not None:
            try:
                on_reserved(res)
            except BaseException:
                core.abort([res.req_id])
                raise

    async def admit_reserved(
        self, request_id: str, first_token: int, logprobs=None, arrival: float | None = None,
    ) -> AsyncIterator[EngineCoreOutput]:
        """Decode role: the reserved blocks hold the prompt's KV; stream from `first_token` on (it is the
        first output). Raises KeyError when the reservation expired or never existed."""
        q: asyncio.Queue = asyncio.Queue()

        def run(core: EngineCore) -> EngineCoreOutput:
            out = core.admit_reserved(request_id, first_token, logprobs)
            now = time.monotonic()
            stream = _Stream(q, arrival or now, computes_prompt=False, last_token_at=now)
            if out.finish_reason is None:
                self._streams[request_id] = stream
            elif self.metrics is not None:
                self.metrics.observe_finished(out.finish_reason, now - stream.arrival)
            return out

        first = await self._call_or_abort(run, request_id)
        try:
            yield first
        except BaseException:  # the consumer left at the first token (GeneratorExit, cancellation)
            if first.finish_reason is None:
                self.abort_nowait(request_id)
            raise
        if first.finish_reason is None:
            async with aclosing(self._drain_stream(q, [request_id])) as stream:
                async for out in stream:
                    yield out

    async def release_held(self, request_id: str) -> bool:
        return await self.call(lambda core: core.release_held(request_id))

    async def abort(self, request_id: str) -> bool:
        """Abort a request (all of its n children) wherever it is; its stream ends with "abort"."""
        return await self.call(lambda core: self._abort(core, request_id))

    def abort_nowait(self, request_id: str) -> None:
        """Queue an abort without waiting for it (from cleanup paths that cannot await)."""
        self._post_command(lambda core: self._abort(core, request_id))

    def run_nowait(self, fn: Callable[[EngineCore], Any]) -> None:
        """Run fn(core) on the engine thread after the commands already queued, without waiting."""
        self._post_command(fn)

    # -- asyncio side helpers -------------------------------------------------------------------------
    async def _grammar_compiled(self, params: SamplingParams) -> None:
        """Wait for the request's grammar off the engine thread (ValueError when it does not compile), so the
        request reaches the scheduler ready and a bad grammar never does."""
        if params.structured_outputs is not None:
            # Shielded: the compile is shared with every request of the same spec; a caller leaving must not
            # cancel it for the others.
            await asyncio.shield(asyncio.wrap_future(self.core.compile_grammar(params.structured_outputs)))

    def _check_accepting(self) -> None:
        if self._draining:
            raise EngineDraining("the node is draining (shutting down) and takes no new requests")

    async def _call_or_abort(self, fn: Callable[[EngineCore], T], request_id: str) -> T:
        try:
            return await self.call(fn)
        except asyncio.CancelledError:
            # The command may still run; an abort queued behind it undoes it (commands run in order).
            self.abort_nowait(request_id)
            raise

    async def _drain_stream(self, q: asyncio.Queue, ids: list[str]) -> AsyncIterator[EngineCoreOutput]:
        left = set(ids)
        try:
            while left:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    left.discard(item.req_id)
                yield item
        finally:
            if left:  # the consumer went away (cancelled RPC, closed generator): free the engine's work
                pending = list(left)
                self._post_command(lambda core: [self._abort(core, rid) for rid in pending])

    def _post_command(self, fn: Callable[[EngineCore], Any]) -> None:
        self._commands.put((fn, None))

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # -- engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._run_commands(block=not self.core.has_unfinished())
                if self._stop:
                    break
                self._expire_leases()
                if self.core.has_queued_reservations():
                    self._admit_reservations()
                if self.core.has_unfinished():
                    self._step()
                self._after_iteration()
        except BaseException as e:  # noqa: BLE001 - whatever killed the thread must reach every waiter
            logger.exception("engine thread crashed")
            self._fail_everyone(EngineDead(f"the engine thread crashed: {e!r}"))

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self.idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._execute(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, fn: Callable[[EngineCore], Any], future: asyncio.Future | None) -> None:
        try:
            result, error = fn(self.core), None
        except Exception as e:  # noqa: BLE001 - the caller gets it
            result, error = None, e
            if future is None:
                logger.warning("engine command failed: %r", e)
        self._answer(future, result, error)

    def _answer(self, future: asyncio.Future | None, result: Any, error: BaseException | None) -> None:
        if future is not None:  # resolved on the event loop, which owns it
            self._post(_resolve, future, result, error)

    def _expire_leases(self) -> None:
        if not self.core.has_leases():
            return
        expired = self.core.expire_leases()
        if expired:
            logger.info("leases expired, blocks freed: %s", ", ".join(expired))
            if self._on_lease_expired is not None:
                self._on_lease_expired(expired)

    def _admit_reservations(self) -> None:
        granted, expired = self.core.admit_queued_reservations()
        for res in granted:
            waiter, on_reserved = self._reserve_waiters.pop(res.req_id, (None, None))
            if waiter is None:  # nobody waits for it any more
                self.core.abort([res.req_id])
                continue
            try:
                self._reserved(self.core, res, on_reserved)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                self._answer(waiter, None, e)
                continue
            self._answer(waiter, res, None)
        for rid in expired:
            waiter, _ = self._reserve_waiters.pop(rid, (None, None))
            self._answer(waiter, None, None)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as e:  # noqa: BLE001 - one bad step must not take the node down
            logger.exception("engine step failed; aborting the requests it ran")
            self._abort_computing(RuntimeError(f"engine step failed: {e!r}"))
            return
        now = time.monotonic()
        batch = []
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:
                continue
            self._observe(stream, out, now)
            batch.append((stream.queue, out))
            if out.finish_reason is not None:
                self._end_stream(out.req_id)
        if batch:
            self._post(_deliver, batch)

    def _observe(self, stream: _Stream, out: EngineCoreOutput, now: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_output(out, now - stream.arrival, stream.last_token_at, now, stream.computes_prompt)
        stream.last_token_at = now

    def _end_stream(self, rid: str) -> _Stream | None:
        stream = self._streams.pop(rid, None)
        if stream is not None and stream.parent is not None:
            left = self._children.get(stream.parent)
            if left is not None:
                left.discard(rid)
                if not left:
                    del self._children[stream.parent]
        return stream

    def _abort(self, core: EngineCore, request_id: str) -> bool:
        ids = sorted(self._children.get(request_id, ())) or [request_id]
        counts = {rid: core.token_counts(rid) for rid in ids}
        done = core.abort(ids)
        waiter, _ = self._reserve_waiters.pop(request_id, (None, None))
        self._answer(waiter, None, None)  # a queued reservation: its caller learns there is none
        now = time.monotonic()
        batch = []
        for rid in done:
            stream = self._end_stream(rid)
            if stream is None:
                continue
            num_prompt, num_cached = counts[rid] or (0, 0)
            batch.append((stream.queue, EngineCoreOutput(rid, (), (), "abort", None, num_prompt, num_cached)))
            if self.metrics is not None:
                self.metrics.observe_finished("abort", now - stream.arrival)
        if batch:
            self._post(_deliver, batch)
        return bool(done)

    def _abort_computing(self, error: BaseException) -> None:
        ids = self.core.request_ids(computing_only=True)
        self.core.abort(ids)
        self._post(_deliver, [(s.queue, error) for rid in ids if (s := self._end_stream(rid)) is not None])

    def _abort_everything(self, core: EngineCore) -> int:
        ids = core.request_ids()
        for rid in ids:
            self._abort(core, rid)
        for rid in core.held_request_ids():
            core.release_held(rid)
        return len(ids)

    def _fail_everyone(self, error: BaseException) -> None:
        self._post(_deliver, [(s.queue, error) for s in self._streams.values()])
        self._streams.clear()
        for waiter, _ in self._reserve_waiters.values():
            self._answer(waiter, None, error)
        self._reserve_waiters.clear()
        while not self._commands.empty():
            item = self._commands.get_nowait()
            if item is not None:
                self._answer(item[1], None, error)

    def _after_iteration(self) -> None:
        self._load = self.core.load()
        if self.metrics is not None:
            self.metrics.observe_stats(self._load, self.core.counters())
            lora = self.core.lora
            if lora is not None:
                self.metrics.observe_lora(*self.core.lora_requests(), lora.stats, lora.drain_load_seconds())
            if self.core.offload is not None:
                self.metrics.observe_offload(self.core.offload.report())
        sink = self._block_events
        if sink is None:
            return
        events = self.core.drain_block_events()
        try:
            if sink.snapshot_wanted:  # the snapshot supersedes the events drained just before it
                sink.submit_snapshot(self.core.cached_block_hashes())
            elif events:
                sink.submit(events)
        except Exception:  # noqa: BLE001 - the index is soft state: never stop the engine for it
            logger.exception("publishing %d block events failed", len(events))


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
