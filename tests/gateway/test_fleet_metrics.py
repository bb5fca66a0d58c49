"""One metrics URL for a fleet (--fleet-metrics, kvrelay.gateway.fleet_metrics): the gateway's /metrics serves its
own kvrelay:* series and every known node's, each labelled node_id and role, scraped from the nodes' real
metrics endpoints (kvrelay.node.metrics); a node that does not answer in time is left out, and said to be down,
without holding the scrape up; /health names a colocated engine as colocated."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from kvrelay.common.prometheus import Metrics
from kvrelay.node.metrics import MetricsServer, NodeMetrics
from tests.gateway.test_fake_nodes import Fleet

TIMEOUT_S = 0.4
MODEL = "SmolLM2-135M-Instruct"


class CountingMetrics(NodeMetrics):
    """A node's metrics, counting the scrapes that reach it."""

    scrapes = 0

    def exposition(self) -> bytes:
        self.scrapes += 1
        return super().exposition()


@pytest.fixture(scope="module")
def fleet(default_tokenizer):
    servers, silent = [], socket.socket()  # `silent` accepts connections and never answers: a hung node
    silent.bind(("127.0.0.1", 0))
    silent.listen()

    def prepare(nodes) -> None:
        prefill, colocated, hung = nodes
        for node, connector in ((prefill, "auto"), (colocated, "local")):
            metrics = CountingMetrics(MODEL, connector)
            server = MetricsServer("127.0.0.1", 0)
            server.start(metrics, lambda: {"healthy": True})
            node.metrics_address, node.connector, node.metrics = server.address, connector, metrics
            servers.append(server)
        hung.metrics_address = f"127.0.0.1:{silent.getsockname()[1]}"
        prefill.metrics.observe_first_token(0.25, 40)
        prefill.metrics.observe_transfer("send", 4096, 0.002)
        colocated.metrics.running.labels(MODEL).set(3)

    f = Fleet(default_tokenizer, n_prefill=1, n_decode=2, prepare=prepare, fleet_metrics=True,
              node_metrics_timeout=TIMEOUT_S)
    yield f
    f.close()
    for server in servers:
        server.close()
    silent.close()


def test_every_nodes_series_labelled_by_node_and_role(fleet):
    t0 = time.monotonic()
    m = Metrics.scrape(fleet.url + "/metrics")
    assert time.monotonic() - t0 < TIMEOUT_S + 1.0  # the hung node costs its timeout, once, not more
    assert m.value("vllm:num_requests_running", node_id="d0", role="colocated") == 3
    assert m.value("vllm:time_to_first_token_seconds_count", node_id="p0", role="prefill") == 1
    assert m.value("vllm:kv_cache_usage_perc", node_id="p0") == 0
    assert m.select("kvrelay:routing_decision_seconds_count")  # the gateway's own beside them
    up = {s.labels["node_id"]: s.value for s in m.select("kvrelay:node_metrics_up")}
    assert up == {"p0": 1.0, "d0": 1.0, "d1": 0.0}
    assert not m.select("vllm:num_requests_running", node_id="d1")
    # No family twice: a family both export holds both kinds of series (the gateway's hand-offs, unlabelled;
    # each node's by direction). No node's *_created.
    families = [f.name for f in m.families]
    assert len(families) == len(set(families))
    assert not [s for s in m.samples if s.name.endswith("_created") and "node_id" in s.labels]
    assert m.value("kvrelay:kv_transfer_bytes_total", node_id="p0", direction="send") == 4096
    assert [s for s in m.select("kvrelay:kv_transfer_bytes_total") if not s.labels]  # the gateway's own


def test_scrapes_within_a_second_share_one_round_of_node_scrapes(fleet):
    _, colocated, _ = fleet.nodes
    time.sleep(1.1)
    before = colocated.metrics.scrapes
    for _ in range(3):
        httpx.get(fleet.url + "/metrics", timeout=10).raise_for_status()
    assert colocated.metrics.scrapes == before + 1


def test_health_names_a_colocated_engine(fleet):
    health = httpx.get(fleet.url + "/health", timeout=10).json()
    roles = {n["node_id"]: n["role"] for n in health["nodes"]}
    assert roles == {"p0": "prefill", "d0": "colocated", "d1": "decode"}
    assert (health["prefill_nodes"], health["decode_nodes"], health["colocated_nodes"]) == (1, 2, 1)


def test_without_fleet_metrics_only_the_gateways_own(default_tokenizer):
    f = Fleet(default_tokenizer, n_prefill=0, n_decode=1)
    try:
        m = Metrics.scrape(f.url + "/metrics")
        assert m.select("kvrelay:requests_total") and not m.select("kvrelay:node_metrics_up")
    finally:
        f.close()
