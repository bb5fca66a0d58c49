"""Prometheus in kvrelay: the one reader of Prometheus text (/metrics of the gateway and the nodes: for `kvrelay
up`'s fleet-wide endpoint, the benchmarks and the tests; parsing is prometheus_client's own), and vLLM's three
request-latency histograms, which the nodes export as vllm:* and the gateway as kvrelay:* for the same requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# vLLM's buckets for time to first token, inter-token latency and end-to-end request latency (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class LatencyHistograms:
    ttft: Histogram
    itl: Histogram
    e2e: Histogram


def latency_histograms(prefix: str, labels: Sequence[str], registry: CollectorRegistry,
                       where: str = "") -> LatencyHistograms:
    """vLLM's request-latency histograms as `<prefix>:time_to_first_token_seconds`,
    `<prefix>:inter_token_latency_seconds` and `<prefix>:e2e_request_latency_seconds`, with vLLM's buckets;
    `where` ends each help text (" at the gateway")."""
    return LatencyHistograms(
        Histogram(f"{prefix}:time_to_first_token_seconds", f"Time to first token{where}", labels,
                  buckets=TTFT_BUCKETS, registry=registry),
        Histogram(f"{prefix}:inter_token_latency_seconds", f"Time between output tokens{where}", labels,
                  buckets=ITL_BUCKETS, registry=registry),
        Histogram(f"{prefix}:e2e_request_latency_seconds", f"Request latency, arrival to finish{where}", labels,
                  buckets=E2E_BUCKETS, registry=registry),
    )


@dataclass(frozen=True)
class Sample:
    name: str  # as exposed, with any _total/_bucket/_sum/_count suffix
    labels: Mapping[str, str]
    value: float


class Metrics:
    """The samples of one scrape; `families` keeps the parsed metric families (name, type, help and samples, as
    prometheus_client's Metric) for a reader that exports them again (the gateway's fleet-wide /metrics)."""

    def __init__(self, samples: Iterable[Sample], families: Iterable[Metric] = ()) -> None:
        self.samples = list(samples)
        self.families = list(families)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        families = list(text_string_to_metric_families(text))
        return cls((Sample(s.name, dict(s.labels), s.value) for family in families for s in family.samples), families)

    @classmethod
    def scrape(cls, url: str, timeout_s: float = 10.0, headers: Mapping[str, str] | None = None) -> Metrics:
        """GET url (a /metrics endpoint) and parse it; httpx errors propagate."""
        import httpx

        reply = httpx.get(url, timeout=timeout_s, headers=dict(headers or {}))
        reply.raise_for_status()
        return cls.parse(reply.text)

    def select(self, name: str, **labels: str) -> list[Sample]:
        """The samples named `name` whose labels include `labels`."""
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float | None:
        """The sum over the matching samples (a counter or gauge over every label set), None if none match."""
        found = self.select(name, **labels)
        return sum(s.value for s in found) if found else None

    def names(self) -> set[str]:
        return {s.name for s in self.samples}
