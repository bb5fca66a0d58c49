"""Compiled grammars, cached per request spec and compiled on a small thread pool, off the step loop.

Lifecycle of a spec:
1. `submit(spec)` returns a future: the cached one (done, or still compiling for an earlier request), or a
   new compile queued on the pool. Equal specs share one compile.
2. The engine holds a request whose future is not done back in the scheduler (WAITING_FOR_GRAMMAR); the
   other requests keep running. A node awaits the future before queueing the request at all, so a bad
   schema is refused with INVALID_ARGUMENT before anything is reserved.
3. `get(spec)` (the model runner, when a request is (re)built) returns the compiled grammar, waiting for it
   or compiling again only if it was evicted.
4. A failed compile stays cached as failed (the same bad schema fails at once next time), least recently
   used entries go first beyond `grammar_cache_size`.

Thread-safe: submit runs on a node's event loop and the engine thread alike.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from kvrelay.common.sampling_params import StructuredOutputs
from kvrelay.engine.config import StructuredOutputsConfig
from kvrelay.engine.structured.base import CompiledGrammar, GrammarBackend

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """`make_backend` builds the grammar engine on first use, on the pool (it reads the tokenizer)."""

    def __init__(self, config: StructuredOutputsConfig, make_backend: Callable[[], GrammarBackend]) -> None:
        self.config = config
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.num_compiles = 0

    def submit(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(1, self.config.grammar_compile_threads), thread_name_prefix="kvrelay-grammar")
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > max(1, self.config.grammar_cache_size):
                self._cache.popitem(last=False)
            return future

    def get(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar (raises the compile's ValueError); blocks only if it is not ready."""
        return self.submit(spec).result()

    def is_ready(self, spec: StructuredOutputs) -> bool:
        with self._lock:
            future = self._cache.get(spec)
        return future is not None and future.done()

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        backend = self._backend_once()
        self.num_compiles += 1
        return backend.compile(spec)

    def _backend_once(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
                logger.info("grammar backend %s ready", self._backend.name)
            return self._backend

    def warm_up(self) -> concurrent.futures.Future:
        """Build the backend now, on the pool (a node calls this at start: the first schema then costs only
        its compile)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(1, self.config.grammar_compile_threads), thread_name_prefix="kvrelay-grammar")
            return self._pool.submit(self._backend_once)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
