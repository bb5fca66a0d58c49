"""Which LoRA adapters an engine knows, holds in memory and runs, and what that costs: the policy the model runner
does not make.

Three tiers, as in vLLM:
- known: every adapter registered by name (--lora-modules at start, load_lora_adapter at runtime), with its path;
- in memory (the CPU cache): at most max_cpu_loras adapters' weights, least recently used first out, but never one
  an unfinished request uses (`in_use`, the engine's answer); an adapter out of memory is read from its path
  again when a request for it arrives;
- in a slot: the max_loras adapters the model can run in one step. The scheduler lets at most max_loras distinct
  adapters into a step; `batch` puts each of a step's adapters in a slot, taking a free one or the least recently
  used one no row of the step needs, and gives the runner the per-row slot numbers.

Counted: reads from files (with their seconds), and evictions from memory and from slots.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvrelay.engine.config import LoRAConfig
from kvrelay.engine.lora.adapter import AdapterError, LoRAAdapter, ModuleShape, read_adapter
from kvrelay.engine.lora.layers import LoRABatch, LoRAProjection

logger = logging.getLogger(__name__)


class UnknownAdapter(LookupError):
    """A request named an adapter this engine does not know (a node answers NOT_FOUND: the client's 404)."""


@dataclass
class LoRAStats:
    """Cumulative counts (the metrics advance by their deltas)."""

    loads: int = 0  # adapters read from their files
    load_seconds: list[float] = field(default_factory=list)  # per read, since the last drain
    cpu_evictions: int = 0  # adapters dropped from memory (read again when asked for)
    slot_loads: int = 0  # adapters copied into a slot
    slot_evictions: int = 0  # adapters taken out of a slot for another one


class LoRAManager:
    """`in_use()`: the adapters unfinished requests use (the engine's), never evicted from memory."""

    def __init__(self, config: LoRAConfig, in_use: Callable[[], set[str]] = set) -> None:
        self.config = config
        self.in_use = in_use
        self.paths: dict[str, str] = {}  # known adapters
        self.unloading: set[str] = set()  # known, but refusing new requests until they are removed
        self.cached: OrderedDict[str, LoRAAdapter] = OrderedDict()  # in memory, least recently used first
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # in a slot, least recently used first
        self.stats = LoRAStats()
        self._free_slots = list(range(config.max_loras))
        self._projections: dict[tuple[int, str], LoRAProjection] = {}  # (layer, shard name) -> its projection
        self._shapes: dict[str, ModuleShape] = {}
        self._num_layers = 0
        self._dtype = torch.float32
        self._device = torch.device("cpu")

    # -- the model -------------------------------------------------------------------------------------

    def attach(self, model) -> None:
        """Give each of the model's projections its slots (model.lora_targets(): (layer, module, shards))."""
        self._dtype = model.dtype
        for layer, module, shards in model.lora_targets():
            weight = module.weight
            self._device = weight.device
            proj = LoRAProjection(weight.shape[1], shards, self.config.max_loras, self.config.max_lora_rank,
                                  weight.dtype, weight.device)
            module.lora = proj
            for name, (_, size) in shards.items():
                self._projections[(layer, name)] = proj
                self._shapes[name] = ModuleShape(weight.shape[1], size)
            self._num_layers = max(self._num_layers, layer + 1)

    def load_modules(self) -> None:
        """Register the adapters the config names (--lora-modules), once attached."""
        for name, path in self.config.lora_modules:
            self.register(name, self.read(name, path))

    # -- known adapters --------------------------------------------------------------------------------

    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter's weights read and checked (AdapterError if malformed); any thread: nothing is changed."""
        if not self._shapes:
            raise AdapterError("LoRA is not enabled on this engine (--enable-lora)")
        start = time.perf_counter()
        adapter = read_adapter(name, path, self._shapes, self._num_layers, self.config.max_lora_rank, self._dtype)
        adapter.read_seconds = time.perf_counter() - start
        return adapter

    def register(self, name: str, adapter: LoRAAdapter) -> None:
        """Know `name` as `adapter` (read by `read`), replacing an adapter of that name no request uses."""
        if name in self.paths and name in self.in_use():
            raise AdapterError(f"adapter {name!r} is already loaded and in use; unload it first")
        self._drop(name)
        self.paths[name] = adapter.path
        self._remember(name, adapter)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %s, %.1f MiB)", name, adapter.path, adapter.rank,
                    ", ".join(adapter.target_modules), adapter.nbytes / 2**20)

    def begin_unload(self, name: str) -> None:
        """Refuse new requests for `name`; `remove` it once the ones running are done."""
        if name not in self.paths:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded on this node")
        self.unloading.add(name)

    def remove(self, name: str) -> bool:
        if name not in self.paths:
            return False
        self._drop(name)
        logger.info("LoRA adapter %s unloaded", name)
        return True

    def _drop(self, name: str) -> None:
        self.paths.pop(name, None)
        self.unloading.discard(name)
        self.cached.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self._free_slots.append(slot)

    def check(self, name: str) -> None:
        """UnknownAdapter unless a request may use `name` now; its weights are brought into memory for it."""
        if not name:
            return
        if name not in self.paths or name in self.unloading:
            raise UnknownAdapter(f"The model `{name}` does not exist: no LoRA adapter of that name is loaded here")
        if name in self.cached:
            self.cached.move_to_end(name)
        else:
            self._remember(name, self.read(name, self.paths[name]))

    def names(self) -> list[str]:
        return sorted(n for n in self.paths if n not in self.unloading)

    def _remember(self, name: str, adapter: LoRAAdapter) -> None:
        self.stats.loads += 1
        self.stats.load_seconds.append(adapter.read_seconds)
        self.cached[name] = adapter
        self.cached.move_to_end(name)
        busy = self.in_use() | {name}
        while len(self.cached) > self.config.cpu_capacity:
            victim = next((n for n in self.cached if n not in busy), None)
            if victim is None:  # every adapter in memory is in use: hold one more for now
                break
            del self.cached[victim]
            self.stats.cpu_evictions += 1
            if victim in self.slot_of:
                self._free_slots.append(self.slot_of.pop(victim))

    # -- a step ----------------------------------------------------------------------------------------

    def batch(self, row_adapters: Sequence[str], row_counts: Sequence[int]) -> LoRABatch | None:
        """The step's slots per flat row (row_adapters[i] for row_counts[i] rows each), every adapter named put
        in a slot; None when no row uses an adapter."""
        names = {n for n in row_adapters if n}
        if not names:
            return None
        if len(names) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(names)} adapters; the scheduler admits at most "
                               f"{self.config.max_loras}")
        for name in names:
            self._activate(name, names)
        per_row = np.array([self.slot_of[n] if n else -1 for n in row_adapters], dtype=np.int32)
        slots = np.repeat(per_row, np.asarray(row_counts, dtype=np.int64))
        return LoRABatch(torch.from_numpy(slots).to(self._device))

    def _activate(self, name: str, needed: set[str]) -> None:
        if name in self.slot_of:
            self.slot_of.move_to_end(name)
            return
        if not self._free_slots:
            victim = next(n for n in self.slot_of if n not in needed)
            self._free_slots.append(self.slot_of.pop(victim))
            self.stats.slot_evictions += 1
        slot = self._free_slots.pop()
        adapter = self.cached.get(name)
        if adapter is None:  # admitted with it in memory; only a re-registration could have dropped it
            adapter = self.read(name, self.paths[name])
            self._remember(name, adapter)
        by_projection: dict[int, tuple[LoRAProjection, dict]] = {}
        for (layer, module), proj in self._projections.items():
            entry = by_projection.setdefault(id(proj), (proj, {}))
            pair = adapter.weights.get((layer, module))
            if pair is not None:
                entry[1][module] = pair
        for proj, weights in by_projection.values():
            proj.set_slot(slot, weights)
        self.slot_of[name] = slot
        self.stats.slot_loads += 1

    def drain_load_seconds(self) -> list[float]:
        seconds, self.stats.load_seconds = self.stats.load_seconds, []
        return seconds


__all__ = ["AdapterError", "LoRAManager", "LoRAStats", "UnknownAdapter"]
