"""Gateway metrics: kvrelay:* for routing, transfers and outcomes, plus vLLM-style request latency histograms.

The latency histograms keep vLLM's names and buckets under the kvrelay: prefix: the nodes already export
vllm:* for the same requests, and one scrape of a whole fleet must not count a request twice.
Each gateway owns a registry, so several gateways in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvrelay.common.prometheus import TTFT_BUCKETS, latency_histograms

_ROUTE_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

CONTENT_TYPE = CONTENT_TYPE_LATEST

OUTCOMES = ("success", "client_error", "unauthorized", "not_found", "no_capacity", "overloaded", "timeout",
            "node_error", "cancelled")


class GatewayMetrics:
    def __init__(self, model_name: str, policy: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name, self.policy = model_name, policy
        m = ["model_name"]
        self.routing_seconds = Histogram("kvrelay:routing_decision_seconds",
                                         "Hashing + index lookup + scoring per request", ["policy"],
                                         buckets=_ROUTE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvrelay:prompt_tokens", "Prompt tokens of routed sequences", m, registry=r)
        self.prefix_hit_tokens = Counter("kvrelay:prefix_hit_tokens",
                                         "Prompt tokens found in the prefix cache of the node that computed the "
                                         "prompt", m, registry=r)
        self.prefix_hit_ratio = Histogram("kvrelay:prefix_hit_ratio", "Cached fraction of each sequence's prompt",
                                          m, buckets=_RATIO_BUCKETS, registry=r)
        # Routing quality: what the index said the chosen node held, and what any node held, per routed prompt;
        # against kvrelay:prefix_hit_tokens (what the node then found) they show a stale index (routed_cached
        # above the hits) and placement that left cache unused (fleet_cached above routed_cached).
        self.routed_prompt_tokens = Counter("kvrelay:routed_prompt_tokens", "Prompt tokens routed", m, registry=r)
        self.routed_cached_tokens = Counter("kvrelay:routed_cached_tokens",
                                            "Prompt tokens the index said the chosen node held (in memory, or in "
                                            "an offload tier it loads from)", m, registry=r)
        self.fleet_cached_tokens = Counter("kvrelay:fleet_cached_tokens",
                                           "Prompt tokens some node or offload tier held when routed (what "
                                           "could have hit)", m,
                                           registry=r)
        self.index_staleness = Gauge("kvrelay:index_staleness_seconds",
                                     "How far the index mirror lags the events it applies (median of the last "
                                     "1,000; 0 without a mirror)", registry=r)
        self.load_imbalance = Gauge("kvrelay:load_imbalance", "Sequences on the busiest routable node over the "
                                    "mean (1 = even)", ["role"], registry=r)
        self.config_mismatches = Counter("kvrelay:node_config_mismatches",
                                         "Nodes refused because their model or block size (the inputs of the block "
                                         "hash) differ from the gateway's", ["node_id", "field"], registry=r)
        self.requests = Counter("kvrelay:requests", "Requests by outcome", ["outcome"], registry=r)
        self.inflight = Gauge("kvrelay:node_inflight_sequences", "This gateway's sequences in flight per node",
                              ["node_id", "role"], registry=r)
        self.sequences = Counter("kvrelay:routed_sequences", "Sequences by prefill mode", ["mode"], registry=r)
        self.transfer_failures = Counter("kvrelay:transfer_failures", "Prefill/KV hand-offs that failed",
                                         registry=r)
        self.reservation_refusals = Counter("kvrelay:reservation_refusals", "Decode reservations refused (full)",
                                            registry=r)
        self.node_failures = Counter("kvrelay:node_failures", "Failed engine calls per node", ["node_id"],
                                     registry=r)
        self.migrations = Counter("kvrelay:migrations", "Sequences re-dispatched to another node after a node "
                                  "failed under them (stage: mid_stream, or before_first_token)", ["stage"], registry=r)
        self.retries = Counter("kvrelay:retries", "Engine calls refused or failed on one node, after which the "
                               "request tried the next (hop: reserve, prefill, local)", ["hop"], registry=r)
        self.rejected = Counter("kvrelay:rejected_requests", "Requests refused at admission (reason: overloaded, "
                                "or a key's rate_limit_exceeded / concurrency_limit, or fairness's shed / "
                                "tenant_share = 429; no_capacity or draining = 503)", ["reason"], registry=r)
        self.request_timeouts = Counter("kvrelay:request_timeouts", "Requests aborted at their deadline "
                                        "(--request-timeout)", registry=r)
        self.index_errors = Counter("kvrelay:index_errors", "Failed or timed-out calls to the block index and node "
                                    "registry (source: lookup, registry)", ["source"], registry=r)
        self.breaker_trips = Counter("kvrelay:breaker_trips", "Times a node's circuit breaker opened", ["node_id"],
                                     registry=r)
        self.transfer_bytes = Counter("kvrelay:kv_transfer_bytes", "KV bytes moved prefill -> decode", registry=r)
        self.transfer_seconds = Histogram("kvrelay:kv_transfer_seconds", "KV transfer time per hand-off",
                                          buckets=TTFT_BUCKETS, registry=r)
        latency = latency_histograms("kvrelay", m, r, where=" at the gateway")
        self.ttft, self.itl, self.e2e = latency.ttft, latency.itl, latency.e2e
        self.request_prompt_tokens = Histogram("kvrelay:request_prompt_tokens", "Prompt tokens per request", m,
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("kvrelay:request_generation_tokens",
                                                   "Generated tokens per request", m, buckets=_TOKEN_BUCKETS,
                                                   registry=r)
        self.request_images = Histogram("kvrelay:request_images", "Images per chat request that has any",
                                        buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.image_bytes = Counter("kvrelay:image_bytes", "Bytes of images taken in chat messages (encoded)",
                                   registry=r)
        for stage in ("mid_stream", "before_first_token"):  # exported at 0 before the first event
            self.migrations.labels(stage)
        for hop in ("reserve", "prefill", "local"):
            self.retries.labels(hop)
        for reason in ("overloaded", "no_capacity", "draining", "rate_limit_exceeded", "concurrency_limit", "shed",
                       "tenant_share"):
            self.rejected.labels(reason)
        for source in ("lookup", "registry"):
            self.index_errors.labels(source)
        # Labelled children resolved once: labels() takes a lock and builds a key on every call.
        self._outcomes = {o: self.requests.labels(o) for o in OUTCOMES}
        self.idempotent_replays = Counter(
            "kvrelay:idempotent_replays", "Requests answered by an earlier copy under the same key "
            "(attached: it was running; stored: it had finished)", ["kind"], registry=r)
        self._modes = {mode: self.sequences.labels(mode) for mode in ("disaggregated", "local")}
        self._route = self.routing_seconds.labels(policy)
        self._prompt, self._hits = self.prompt_tokens.labels(model_name), self.prefix_hit_tokens.labels(model_name)
        self._ratio = self.prefix_hit_ratio.labels(model_name)
        self._ttft, self._itl, self._e2e = (h.labels(model_name) for h in (self.ttft, self.itl, self.e2e))
        self._req_prompt = self.request_prompt_tokens.labels(model_name)
        self._req_gen = self.request_generation_tokens.labels(model_name)
        self._inflight: dict[tuple[str, str], object] = {}
        self._routed = (self.routed_prompt_tokens.labels(model_name), self.routed_cached_tokens.labels(model_name),
                        self.fleet_cached_tokens.labels(model_name))

    def watch(self, discovery, index=None) -> None:
        """Gauges read at scrape time: the index mirror's lag (an index with `lag_ms`), load imbalance per role."""
        lags = getattr(index, "lag_ms", None)
        if lags is not None:
            self.index_staleness.set_function(lambda: _median(list(lags)[-1000:]) / 1000)
        for role in ("prefill", "decode"):
            self.load_imbalance.labels(role).set_function(lambda role=role: imbalance(discovery.routable(role)))

    def watch_admission(self, activity, max_concurrent: int) -> None:
        """Admission's gauges, read at scrape time: generations in progress per tenant, and the share of the
        bound taken (llm-d's flow_control_queue_size and pool_saturation, for a gateway that does not queue)."""
        self.registry.register(_AdmissionCollector(activity, max_concurrent))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------------------------- hooks

    def observe_images(self, count: int, nbytes: int) -> None:
        self.request_images.observe(count)
        self.image_bytes.inc(nbytes)

    def observe_route(self, decision) -> None:
        self._route.observe(decision.seconds)
        prompt, routed, fleet = self._routed
        prompt.inc(decision.num_prompt_tokens)
        routed.inc(decision.decode_cached_tokens if decision.prefill is None else decision.prefill_cached_tokens)
        fleet.inc(decision.fleet_cached_tokens)

    def observe_mismatch(self, node_id: str, field: str) -> None:
        self.config_mismatches.labels(node_id, field).inc()

    def observe_prefix(self, num_prompt: int, num_cached: int) -> None:
        self._prompt.inc(num_prompt)
        self._hits.inc(num_cached)
        if num_prompt:
            self._ratio.observe(num_cached / num_prompt)

    def observe_mode(self, local: bool) -> None:
        self._modes["local" if local else "disaggregated"].inc()

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        self.transfer_bytes.inc(num_bytes)
        if seconds > 0:
            self.transfer_seconds.observe(seconds)

    def node_inflight(self, node_id: str, role: str, delta: int) -> None:
        child = self._inflight.get((node_id, role))
        if child is None:
            child = self._inflight[(node_id, role)] = self.inflight.labels(node_id, role)
        child.inc(delta)

    def observe_request(self, outcome: str) -> None:
        self._outcomes[outcome].inc()

    def observe_replay(self, kind: str) -> None:
        self.idempotent_replays.labels(kind).inc()

    def observe_latency(self, ttft: float | None, itls: list[float], e2e: float, prompt: int, generated: int) -> None:
        if ttft is not None:
            self._ttft.observe(ttft)
        for v in itls:
            self._itl.observe(v)
        self._e2e.observe(e2e)
        self._req_prompt.observe(prompt)
        self._req_gen.observe(generated)


def imbalance(nodes) -> float:
    """Sequences (running and waiting) on the busiest node over the mean: 1.0 when even or idle."""
    loads = [n.active_seqs for n in nodes]
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[len(values) // 2]


class _AdmissionCollector:
    """kvrelay:tenant_requests_in_progress{tenant} and kvrelay:admission_saturation, from gateway.admission.Activity."""

    def __init__(self, activity, max_concurrent: int) -> None:
        self.activity, self.max_concurrent = activity, max_concurrent

    def collect(self):
        tenants = GaugeMetricFamily("kvrelay:tenant_requests_in_progress",
                                    "This gateway's generations in progress, by tenant (the API key's)",
                                    labels=["tenant"])
        for tenant, count in sorted(self.activity.by_tenant.items()):
            tenants.add_metric([tenant], count)
        yield tenants
        saturation = self.activity.active / self.max_concurrent if self.max_concurrent else 0.0
        yield GaugeMetricFamily("kvrelay:admission_saturation", "Generations in progress over "
                                "--max-concurrent-requests (0 without a bound)", value=saturation)
