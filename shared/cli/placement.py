"""Where `kvrelay up` puts its engines: for each of the fleet's models, colocated engines (each prefills for itself)
or prefill and decode nodes, the torch threads of each engine, the KV connector, and why.

One model: one prefill and one decode node where each gets MIN_CORES_PER_ENGINE cores, else one colocated engine
with every core; --colocated, --prefill 0 or explicit counts are followed. Several models (repeated --model, or a
fleet file): each model's engines are chosen the same way, and the cores are split over every engine of the fleet.
The first model's nodes keep their plain names (decode-0); another model's are prefixed with its tag.

With --reserved-cores N (vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU), the first N usable cores are left to the gateway,
Redis and whatever else runs there (a load generator), and each engine is pinned to its own share of the rest:
a step then loses no time to a thread of the gateway's, which on a few cores stretches every step.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.common.system import format_cores, usable_cores
from kvrelay.node.config import NodeConfig

if TYPE_CHECKING:
    from kvrelay.cli.up_config import FleetModel, UpConfig

MIN_CORES_PER_ENGINE = 2  # disaggregation below this: each prefill runs on one core while decodes hold the rest
_NODE = NodeConfig()


@dataclass(frozen=True)
class Placement:
    """What `up` runs where for one model: colocated engines or how many nodes of each role, torch threads per
    engine, the KV connector, and why; `others`: the fleet's other models' placements."""

    colocated: bool
    prefill: int
    decode: int  # engines that decode: the colocated ones too
    threads: int
    connector: str
    note: str
    model: FleetModel | None = None  # None: the config's only model
    prefix: str = ""  # before each node name ("" for the first model)
    others: tuple[Placement, ...] = ()
    cores: tuple[tuple[int, ...], ...] = ()  # each own node's cores, as own_node_names() lists them; (): unpinned
    reserved: tuple[int, ...] = ()  # the cores left to the gateway and Redis (the fleet's first placement only)

    def own_node_names(self) -> list[tuple[str, str]]:
        """(role, name) of this model's nodes: a colocated engine is a decode node named colocated-<i>."""
        if self.colocated:
            return [("decode", f"{self.prefix}colocated-{i}") for i in range(self.decode)]
        return [("prefill", f"{self.prefix}prefill-{i}") for i in range(self.prefill)] + \
               [("decode", f"{self.prefix}decode-{i}") for i in range(self.decode)]

    def node_names(self) -> list[tuple[str, str]]:
        """(role, name) of every node of the fleet."""
        return [name for p in self.models() for name in p.own_node_names()]

    def models(self) -> list[Placement]:
        return [self, *self.others]

    def layout(self) -> str:
        if self.others:
            return "; ".join(f"{_label(p)}: {p._own_layout()}" for p in self.models())
        return self._own_layout()

    def _own_layout(self) -> str:
        if self.colocated:
            return "colocated (1 engine)" if self.decode == 1 else f"colocated ({self.decode} engines)"
        return f"{self.prefill} prefill + {self.decode} decode"


def placement(config: UpConfig) -> Placement:
    """The fleet's placement, the first model's at the top. (Impossible shapes were refused before:
    kvrelay.cli.preflight.check_fleet_shape.)"""
    models = config.fleet_models()
    cores = os.cpu_count() or 1
    shapes = [_shape(config, m, cores, len(models)) for m in models]
    engines = sum(decode if colocated else prefill + decode for colocated, prefill, decode in shapes)
    threads = max(1, cores // engines)
    pinned: list[tuple[int, ...]] = []
    reserved: tuple[int, ...] = ()
    if config.reserved_cores:  # preflight made sure some are left
        usable = usable_cores()
        reserved, pool = usable[:config.reserved_cores], usable[config.reserved_cores:]
        threads = max(1, len(pool) // engines)
        # An engine each to its own cores; with fewer cores than engines, one core each, taken in turn.
        pinned = [pool[i * threads:(i + 1) * threads] if len(pool) >= engines else (pool[i % len(pool)],)
                  for i in range(engines)]
    places = []
    tags: set[str] = set()
    for i, (model, (colocated, prefill, decode)) in enumerate(zip(models, shapes)):
        prefix = "" if i == 0 else _unique(tag(model.model), tags) + "-"
        place = _place(config, model if len(models) > 1 else None, colocated, prefill, decode, threads, cores, prefix)
        if pinned:
            own, pinned = pinned[:len(place.own_node_names())], pinned[len(place.own_node_names()):]
            note = (f"{place.note}; engines on cores {', '.join(format_cores(c) for c in own)}, the gateway and "
                    f"Redis on {format_cores(reserved)} (--reserved-cores)")
            place = Placement(**{**place.__dict__, "cores": tuple(own), "note": note})
        places.append(place)
    return Placement(**{**places[0].__dict__, "others": tuple(places[1:]), "reserved": reserved})


def _shape(config: UpConfig, model: FleetModel, cores: int, num_models: int) -> tuple[bool, int, int]:
    prefill = model.prefill if model.prefill is not None else config.prefill
    decode = model.decode if model.decode is not None else config.decode
    explicit = prefill is not None or decode is not None
    wanted = config.colocated or model.colocated
    colocated = wanted or prefill == 0 or (not explicit and cores < 2 * MIN_CORES_PER_ENGINE * num_models)
    decode = decode or 1
    return colocated, 0 if colocated else (1 if prefill is None else prefill), decode


def _place(config: UpConfig, model: FleetModel | None, colocated: bool, prefill: int, decode: int, threads: int,
           cores: int, prefix: str) -> Placement:
    explicit = model is not None and (model.prefill is not None or model.decode is not None)
    explicit = explicit or config.prefill is not None or config.decode is not None
    wanted = config.colocated or (model is not None and model.colocated)
    note = f"{cores} CPU cores: {threads} torch thread(s) per engine"
    if colocated and not explicit and not wanted:
        note += (f"; one colocated engine, as disaggregating would leave each engine under {MIN_CORES_PER_ENGINE} "
                 "cores (docs/benchmarks.md: time to first token 3x the colocated one at concurrency 32 on 2 "
                 "cores); --prefill 1 --decode 1 disaggregates anyway")
    elif not colocated and threads < MIN_CORES_PER_ENGINE:
        note += ("; with a core or less per engine, each prefill runs on one core while decodes hold the other: "
                 "time to first token suffers most (docs/benchmarks.md: 3x the colocated TTFT at concurrency 32 "
                 "on 2 cores). --colocated gives one engine every core")
    connector = config.connector or _NODE.connector.name
    if colocated and not config.connector:
        # auto would start a UCX worker whose progress thread wakes every millisecond, for a node that never
        # sends or receives KV: 2-3% of served throughput on 2 cores (docs/benchmarks.md).
        connector = "local"
        note += "; KV connector local, as a lone engine hands KV to no other process"
    return Placement(colocated, prefill, decode, threads, connector, note, model, prefix)


def tag(model: str) -> str:
    """A short name for a model in node names: its folder's or file's name, in letters, digits, '.', '_', '-'."""
    name = Path(model.rstrip("/")).name or model
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name.removesuffix(".gguf")).strip("-").lower() or "model"


def _unique(name: str, taken: set[str]) -> str:
    out, i = name, 1
    while out in taken:
        i += 1
        out = f"{name}{i}"
    taken.add(out)
    return out


def _label(p: Placement) -> str:
    if p.model is None:
        return "model"
    return p.model.served_model_names[0] if p.model.served_model_names else tag(p.model.model)
