"""A node's metrics endpoint (kvrelay.node.metrics.MetricsServer) answers from before the model loads: /health is
503 {"status": "loading"} until the node serves (what `kvrelay up` reports as progress, and what a startup probe
waits on), then the node's own health and metrics, among them the engine's settings as it runs with them. It
closes within a fraction of a second."""

from __future__ import annotations

import time

import httpx

from kvrelay.common.prometheus import Metrics
from kvrelay.engine.config import EngineConfig
from kvrelay.node.metrics import MetricsServer, NodeMetrics


def test_loading_then_serving_then_closed_quickly():
    server = MetricsServer("127.0.0.1", 0)
    url = f"http://{server.address}"
    try:
        server.start_loading()
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert httpx.get(url + "/metrics", timeout=5).status_code == 503
        metrics = NodeMetrics("m", "local")
        config = EngineConfig().with_kwargs(max_num_seqs=2, max_num_batched_tokens=256, seed=7,
                                            enable_prefix_caching=False, gpu_memory_utilization=0.5)
        metrics.observe_config(config, "cpu", "float32", 1024, 99)
        server.start(metrics, lambda: {"healthy": True, "draining": False})
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        m = Metrics.parse(httpx.get(url + "/metrics", timeout=5).text)
        (engine,) = m.select("kvrelay:engine_config_info")
        assert engine.value == 1 and engine.labels == {
            "device": "cpu", "dtype": "float32", "max_model_len": "1024", "max_num_seqs": "2",
            "max_num_batched_tokens": "256", "seed": "7", "scheduling_policy": "fcfs"}
        (cache,) = m.select("vllm:cache_config_info")
        assert cache.labels == {"block_size": "16", "cache_dtype": "float32", "enable_prefix_caching": "False",
                                "gpu_memory_utilization": "0.5", "num_gpu_blocks": "99"}
    finally:
        t0 = time.monotonic()
        server.close()
        assert time.monotonic() - t0 < 0.5
