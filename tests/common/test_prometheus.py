"""The one /metrics reader, on what prometheus_client writes (served over real HTTP for `scrape`), and vLLM's
request-latency histograms that the gateway and the nodes both export."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvrelay.common.prometheus import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Metrics, latency_histograms


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    requests = Counter("kvrelay:requests", "Requests by outcome", ["outcome"], registry=r)
    requests.labels("success").inc(3)
    requests.labels("timeout").inc(2)
    Gauge("vllm:num_requests_running", "Running", ["model_name"], registry=r).labels("m").set(4)
    latency = latency_histograms("vllm", ["model_name"], r)
    for seconds in (0.003, 0.2):
        latency.ttft.labels("m").observe(seconds)
    return r


def test_parse_keeps_the_families_for_exporting_again():
    metrics = Metrics.parse(generate_latest(_registry()).decode())
    families = {f.name: f for f in metrics.families}
    assert families["kvrelay:requests"].type == "counter"
    assert families["vllm:num_requests_running"].documentation == "Running"
    ttft = families["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram" and {s.name for s in ttft.samples} >= {
        "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_count"}
    assert sum(len(f.samples) for f in metrics.families) == len(metrics.samples)


def test_parse_sums_and_selects_by_labels():
    metrics = Metrics.parse(generate_latest(_registry()).decode())
    assert metrics.value("kvrelay:requests_total") == 5  # every label set
    assert metrics.value("kvrelay:requests_total", outcome="timeout") == 2
    assert metrics.value("kvrelay:requests_total", outcome="cancelled") is None
    assert metrics.value("vllm:num_requests_running", model_name="m") == 4
    assert [s.labels for s in metrics.select("kvrelay:requests_total")] == [{"outcome": "success"},
                                                                          {"outcome": "timeout"}]
    assert metrics.value("vllm:time_to_first_token_seconds_count", model_name="m") == 2
    assert metrics.value("vllm:time_to_first_token_seconds_bucket", model_name="m", le="0.005") == 1
    assert metrics.value("vllm:time_to_first_token_seconds_sum") == pytest.approx(0.203)
    assert {"kvrelay:requests_total", "vllm:num_requests_running", "vllm:time_to_first_token_seconds_count"} \
        <= metrics.names()
    assert "vllm:inter_token_latency_seconds_count" not in metrics.names()  # no label set observed yet


def test_latency_histograms_have_vllms_names_and_buckets():
    r = CollectorRegistry()
    latency = latency_histograms("kvrelay", ["model_name"], r, where=" at the gateway")
    for histogram, buckets in ((latency.ttft, TTFT_BUCKETS), (latency.itl, ITL_BUCKETS), (latency.e2e, E2E_BUCKETS)):
        histogram.labels("m")
        assert histogram._upper_bounds == [*buckets, float("inf")]
    families = {f.name: f.documentation for f in r.collect()}
    assert families == {"kvrelay:time_to_first_token_seconds": "Time to first token at the gateway",
                        "kvrelay:inter_token_latency_seconds": "Time between output tokens at the gateway",
                        "kvrelay:e2e_request_latency_seconds": "Request latency, arrival to finish at the gateway"}


def test_scrape_reads_an_endpoint_and_raises_on_an_error_status():
    body = generate_latest(_registry())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            ok = self.path == "/metrics"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(body if ok else b"no")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert Metrics.scrape(base + "/metrics").value("kvrelay:requests_total", outcome="success") == 3
        with pytest.raises(httpx.HTTPStatusError):
            Metrics.scrape(base + "/other")
    finally:
        server.shutdown()
        server.server_close()
