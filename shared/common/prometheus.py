"""The one reader of Prometheus text (/metrics of the gateway and the nodes): for `kvrelay up`'s fleet-wide
endpoint, the benchmarks and the tests. Parsing is prometheus_client's own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str  # as exposed, with any _total/_bucket/_sum/_count suffix
    labels: Mapping[str, str]
    value: float


class Metrics:
    """The samples of one scrape."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self.samples = list(samples)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        return cls(Sample(s.name, dict(s.labels), s.value)
                   for family in text_string_to_metric_families(text) for s in family.samples)

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
