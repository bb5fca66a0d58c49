"""LoRA adapters across the fleet: which the gateway serves, on which nodes each is loaded, and loading and
unloading them there (vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, for a whole fleet).

An adapter is known to the gateway in one of two ways:
- loaded through the gateway (`load`): its path is recorded, it is loaded on every LoRA-capable node of its base
  model (prefill and decode alike), and later on any node routing picks that lacks it (`ensure`: a node that
  joined or restarted since), so a burst for one adapter can spread past the nodes that had it;
- loaded on nodes at their start (--lora-modules): the nodes report it, with its path, in their load; it runs on
  those, and on others the same way as above.

Residency, what routing weighs against cache and load (`extra_cost`, in prompt-token equivalents like every
routing cost): the adapter in the node's memory already (0), not there but room for it (it is read from its files
first), or room only by evicting another adapter. A node without LoRA, or one that lacks the adapter when the
gateway has no path to load it from, is not a candidate at all.

Unloading takes the adapter out of the gateway's table first (new requests for it get 404), then unloads it on
every node holding it; each node answers once the adapter's running requests are done, so none fails. The nodes'
loads the gateway holds may predate the unload: what a holder reports of the adapter is ignored until a load of
its no longer lists it, so a stale report never brings the adapter back (nor has the gateway load it again).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.gateway.discovery import Node
from kvrelay.gateway.errors import BadRequest, ModelNotFound, NodeFailure
from kvrelay.gateway.node_client import NodeClients, NodeRpcError

logger = logging.getLogger(__name__)


class Residency(enum.Enum):
    LOADED = "loaded"  # in the node's memory
    FREE = "free"  # the node has room for it without evicting another adapter
    EVICT = "evict"  # loading it evicts another adapter from the node's memory


# What each residency adds to a node's routing cost, in prompt tokens: reading an adapter costs about as much as
# computing a short prompt; evicting one costs another read later.
RESIDENCY_COST = {Residency.LOADED: 0.0, Residency.FREE: 64.0, Residency.EVICT: 256.0}


@dataclass
class AdapterRecord:
    name: str
    model_id: str  # the base model it applies to
    path: str | None  # None: loaded on nodes at their start; the gateway cannot load it elsewhere
    loaded_on: set[str] = field(default_factory=set)  # node ids the gateway loaded it on


class Adapters:
    """`nodes()`: every known node (discovery's); `clients`: the nodes' engine clients."""

    def __init__(self, nodes: Callable[[], list[Node]], clients: NodeClients) -> None:
        self.nodes = nodes
        self.clients = clients
        self.records: dict[str, AdapterRecord] = {}
        self._loading: dict[tuple[str, str], asyncio.Future] = {}  # (node id, adapter) -> the load in flight
        self._unloading: set[str] = set()
        self._seen: list[Node] | None = None
        self._reported: dict[str, AdapterRecord] = {}  # adapter -> its record, from the nodes' loads
        # adapter -> the nodes that held it when it was unloaded: their loads may predate the unload, so what they
        # report of it is not believed until a load of theirs no longer lists it.
        self._gone: dict[str, set[str]] = {}

    # ----------------------------------------------------------------------------------------- table

    def get(self, name: str) -> AdapterRecord | None:
        """The adapter of this name the fleet serves, or None."""
        if name in self._unloading:
            return None
        return self.records.get(name) or self.reported().get(name)

    def reported(self) -> dict[str, AdapterRecord]:
        """Adapters the nodes report holding (their base model, and the path the first reporting node read)."""
        nodes = self.nodes()
        if nodes is not self._seen:  # discovery rebuilds its list when anything changed
            self._seen = nodes
            found: dict[str, AdapterRecord] = {}
            for n in nodes:
                load = n.load
                if load is None:
                    continue
                paths = load.lora_paths if len(load.lora_paths) == len(load.lora_adapters) else ()
                for i, name in enumerate(load.lora_adapters):
                    if not self._stale(n, name):
                        found.setdefault(name, AdapterRecord(name, n.model_id, paths[i] if paths else None))
            for name, stale in list(self._gone.items()):
                stale &= {n.node_id for n in nodes if n.load is not None and name in n.load.lora_adapters}
                if not stale:
                    del self._gone[name]
            self._reported = found
        return self._reported

    def served(self) -> list[AdapterRecord]:
        names = sorted(set(self.records) | set(self.reported()))
        return [r for r in map(self.get, names) if r is not None]

    # ------------------------------------------------------------------------------------- residency

    def holds(self, node: Node, name: str) -> bool:
        record = self.records.get(name)
        if record is not None and node.node_id in record.loaded_on:
            return True
        return node.load is not None and name in node.load.lora_adapters and not self._stale(node, name)

    def _stale(self, node: Node, name: str) -> bool:
        """Whether what `node` reports of adapter `name` may predate its unload (and so is not believed)."""
        return node.node_id in self._gone.get(name, ())

    def extra_cost(self, node: Node, name: str) -> float | None:
        """What running adapter `name` adds to the node's routing cost; None: the node cannot run it."""
        load = node.load
        if load is None or not load.lora_capacity:
            return None
        if not self.holds(node, name):
            record = self.get(name)
            if record is None or record.path is None or record.model_id != node.model_id:
                return None
        return RESIDENCY_COST[residency(node, name)]

    # ---------------------------------------------------------------------------------- on the nodes

    async def ensure(self, node: Node, name: str) -> None:
        """The adapter is loaded on `node` (loaded now if the gateway knows its path and the node lacks it)."""
        if not name or self.holds(node, name):
            return
        record = self.get(name)
        if record is None or record.path is None:
            return  # the node's own answer (NOT_FOUND) moves the request on
        key = (node.node_id, name)
        future = self._loading.get(key)
        if future is None:
            future = self._loading[key] = asyncio.ensure_future(self._load_on(node, record))
            future.add_done_callback(lambda _f: self._loading.pop(key, None))
        await asyncio.shield(future)

    async def _load_on(self, node: Node, record: AdapterRecord) -> None:
        await self.clients.get(node.address).load_lora_adapter(record.name, record.path)
        record.loaded_on.add(node.node_id)
        logger.info("LoRA adapter %s loaded on node %s", record.name, node.node_id)

    async def load(self, name: str, path: str, model_ids: list[str], base_model: str | None = None) -> AdapterRecord:
        """Load `name` from `path` on every LoRA-capable node of its base model (`base_model`, or the one model
        with such nodes). A node refusing the adapter as malformed makes it a 400, and it is unloaded from the
        nodes that had taken it."""
        if not name or not path:
            raise BadRequest("lora_name and lora_path are both required", param="lora_name")
        if name in self.records or name in self.reported() or name in model_ids:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                             code="lora_adapter_exists")
        model_id = base_model or self._only_lora_model(model_ids)
        nodes = [n for n in self.nodes() if n.model_id == model_id and n.routable and n.load is not None
                 and n.load.lora_capacity]
        if not nodes:
            raise BadRequest(f"no node of model {model_id!r} serves LoRA adapters (start them with --enable-lora)",
                             param="lora_name")
        record = AdapterRecord(name, model_id, path)
        results = await asyncio.gather(*(self._load_on(n, record) for n in nodes), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        refused = next((e for e in errors if isinstance(e, NodeRpcError) and e.bad_input), None)
        if refused is not None or len(errors) == len(nodes):
            await self._unload_from(record, [n for n in nodes if n.node_id in record.loaded_on])
            if refused is not None:
                raise BadRequest(refused.details, param="lora_path")
            raise NodeFailure(f"no node could load LoRA adapter {name!r}: {errors[0]}")
        for node, err in zip(nodes, results):
            if isinstance(err, BaseException):
                logger.warning("LoRA adapter %s not loaded on %s (loaded there when routed): %s", name,
                               node.node_id, err)
        self.records[name] = record
        self._forget_unload(name)
        return record

    async def unload(self, name: str) -> None:
        record = self.get(name)
        if record is None:
            raise ModelNotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self._unloading.add(name)
        try:
            holders = [n for n in self.nodes() if self.holds(n, name)]
            await self._unload_from(record, holders)
            self.records.pop(name, None)
            self._gone[name] = {n.node_id for n in holders}
        finally:
            self._unloading.discard(name)
            self._seen = None  # the table is rebuilt without what the holders' older loads say of it

    def _forget_unload(self, name: str) -> None:
        """`name` was loaded again: what the nodes report of it counts from now on."""
        if self._gone.pop(name, None) is not None:
            self._seen = None

    async def _unload_from(self, record: AdapterRecord, nodes: list[Node]) -> None:
        async def one(node: Node) -> None:
            try:
                await self.clients.get(node.address).unload_lora_adapter(record.name)
            except NodeRpcError as e:
                if e.code.name != "NOT_FOUND":
                    logger.warning("unloading LoRA adapter %s on %s: %s", record.name, node.node_id, e)
            record.loaded_on.discard(node.node_id)

        await asyncio.gather(*(one(n) for n in nodes))

    def _only_lora_model(self, model_ids: list[str]) -> str:
        models = sorted({n.model_id for n in self.nodes() if n.load is not None and n.load.lora_capacity})
        if len(models) == 1:
            return models[0]
        if not models:
            raise BadRequest("no node serves LoRA adapters (start them with --enable-lora)", param="lora_name")
        raise BadRequest(f"several models serve LoRA adapters ({', '.join(models)}): name the adapter's base model "
                         "in base_model_name", param="base_model_name")


def residency(node: Node, name: str) -> Residency:
    load = node.load
    if load is not None and name in load.lora_resident:
        return Residency.LOADED
    if load is not None and len(load.lora_resident) < load.lora_capacity:
        return Residency.FREE
    return Residency.EVICT
