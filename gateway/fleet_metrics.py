"""The whole fleet's metrics at the gateway's /metrics (--fleet-metrics; `kvrelay up` turns it on): one URL with
vLLM's series of every node, so that dashboards and autoscalers written for vLLM work against a local fleet.

A scrape of /metrics returns the gateway's own series (kvrelay:*) and each known node's series as the node
exported them, with two labels added: `node_id` and `role` (prefill, decode, or colocated for an engine that
computes its own prompts). A family both export (kvrelay:kv_transfer_*: the gateway counts hand-offs, each node
its sends or receives by direction) is one family with both kinds of series. The nodes are scraped at once, each
within --node-metrics-timeout, and their series are kept for CACHE_S, so several scrapers cost one round. A node
that does not answer in time is left out, and `kvrelay:node_metrics_up{node_id, role}` says so (0; 1 for a node
that answered), as Prometheus's own `up` series does for its targets.

Where Prometheus scrapes every node itself (Kubernetes), leave this off: it would count each node's series twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from kvrelay.common.prometheus import Metrics
from kvrelay.gateway.discovery import Node

logger = logging.getLogger(__name__)

CACHE_S = 1.0
UP = "kvrelay:node_metrics_up"


class FleetMetrics:
    """`render()`: the gateway's own exposition (`own`, a CollectorRegistry) followed by the nodes'."""

    def __init__(self, own: CollectorRegistry, nodes: Callable[[], list[Node]], timeout_s: float,
                 cache_s: float = CACHE_S) -> None:
        self.own = own
        self.nodes = nodes
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self._client: httpx.AsyncClient | None = None
        self._cached: tuple[float, list[Metric]] | None = None
        self._lock = asyncio.Lock()

    async def render(self) -> bytes:
        nodes = {family.name: family for family in await self._node_families()}
        families = []
        for family in self.own.collect():  # the gateway's own, fresh; a node family of the same name joins it
            joined = nodes.pop(family.name, None)
            if joined is not None and joined.type == family.type:
                family = _family(family, family.samples + joined.samples)
            families.append(family)
        return generate_latest(_Families(families + list(nodes.values())))

    async def _node_families(self) -> list[Metric]:
        async with self._lock:  # concurrent scrapes share one round of node scrapes
            if self._cached is not None and time.monotonic() - self._cached[0] < self.cache_s:
                return self._cached[1]
            nodes = [n for n in self.nodes() if n.metrics_address]
            texts = await asyncio.gather(*(self._scrape(n) for n in nodes))
            families = merge(zip(nodes, texts))
            self._cached = (time.monotonic(), families)
            return families

    async def _scrape(self, node: Node) -> str | None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        try:
            reply = await self._client.get(f"http://{node.metrics_address}/metrics")
            reply.raise_for_status()
            return reply.text
        except httpx.HTTPError as e:
            logger.debug("metrics of %s at %s: %s", node.node_id, node.metrics_address, e)
            return None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def merge(scraped: Iterable[tuple[Node, str | None]]) -> list[Metric]:
    """One family per name across the nodes, each sample labelled with its node_id and role, and
    kvrelay:node_metrics_up last. A node whose text does not parse counts as down."""
    families: dict[str, Metric] = {}
    up = Metric(UP, "1 if the node's /metrics answered the gateway's last fleet scrape in time, else 0", "gauge")
    for node, text in scraped:
        labels = {"node_id": node.node_id, "role": node.kind}
        try:
            parsed = Metrics.parse(text).families if text is not None else None
        except ValueError as e:
            logger.warning("metrics of %s do not parse: %s", node.node_id, e)
            parsed = None
        up.add_sample(UP, labels, 0.0 if parsed is None else 1.0)
        for family in parsed or ():
            if family.name == UP or family.name.endswith("_created"):
                continue  # (prometheus_client's *_created series: creation times, of no use fleet-wide)
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = _family(family, [])
            merged.samples += [Sample(s.name, {**s.labels, **labels}, s.value, s.timestamp, s.exemplar)
                               for s in family.samples]
    return [*families.values(), up]


def _family(like: Metric, samples: list[Sample]) -> Metric:
    family = Metric(like.name, like.documentation, like.type, like.unit)
    family.samples = samples
    return family


class _Families:
    """A collector of given families, for prometheus_client's exposition."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
