"""Prometheus metrics of a node (vLLM names and meanings) and the HTTP endpoint serving /metrics and /health.

Each node owns a CollectorRegistry of its own, so two nodes in one process (tests) never collide.
Where a number is counted:
- vllm:time_to_first_token_seconds: from the RPC's arrival to the first token, for prompts computed here
  (local Generate, Prefill). A decode node admitting a hand-off got its first token from elsewhere.
- vllm:prompt_tokens: prompts computed here; vllm:generation_tokens: tokens sampled here.
- vllm:prefix_cache_*, vllm:num_preemptions: the scheduler's cumulative counters (reservations included).
- kvrelay:kv_transfer_*: per finished transfer, direction "send" on prefill nodes, "recv" on decode nodes.
- vllm:spec_decode_*: speculative decoding's verifications (num_drafts), drafts verified and accepted, and
  accepted drafts by their position in a run (label position, 0 = first draft): acceptance rate is
  num_accepted_tokens / num_draft_tokens, mean accepted run num_accepted_tokens / num_drafts.
- kvrelay:images_encoded, kvrelay:image_encoder_seconds (a vision-language model): images encoded on this node,
  and the seconds their decoding, preprocessing and encoding took; a decode node given the KV encodes none.
- vllm:cache_config_info (vLLM's) and kvrelay:engine_config_info: the engine's settings as it runs with them,
  as labels of a gauge at 1 (what --max-num-seqs, --seed, --device ... came to, on the node itself).
- vllm:lora_requests_info (vLLM's, with LoRA on): the adapters of running and waiting requests and max_lora as
  labels (comma-separated names), the value the time they last changed; kvrelay:lora_adapter_loads (adapters read
  from their files), kvrelay:lora_adapter_load_seconds, kvrelay:lora_adapter_evictions{tier} (tier "memory":
  dropped from the in-memory cache, read again when asked for; "slot": taken out of a model slot for another).

The endpoint answers from before the model loads: /health is 503 {"status": "loading"} until the node serves.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvrelay.common.prometheus import latency_histograms

logger = logging.getLogger(__name__)

# vLLM's label names for its cache info (a subset); ours for the rest of the engine's settings.
_CACHE_INFO = ["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization", "num_gpu_blocks"]
_ENGINE_INFO = ["device", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "seed",
                "scheduling_policy"]
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class NodeMetrics:
    def __init__(self, model_name: str, connector: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.connector = connector
        m, reg = ["model_name"], self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", m, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", m, registry=reg)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", m, registry=reg)
        self.queued_prefill = Gauge("kvrelay:queued_prefill_tokens", "Prompt tokens not computed yet", m,
                                    registry=reg)
        latency = latency_histograms("vllm", m, reg)
        self.ttft, self.itl, self.e2e = latency.ttft, latency.itl, latency.e2e
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", m, registry=reg)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", m,
                                     registry=reg)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions", m, registry=reg)
        self.images_encoded = Counter("kvrelay:images_encoded", "Images run through the vision encoder here", m,
                                      registry=reg)
        self.image_encoder_seconds = Counter("kvrelay:image_encoder_seconds", "Seconds spent decoding, "
                                             "preprocessing and encoding images (part of their requests' TTFT)", m,
                                             registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens computed", m, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", m, registry=reg)
        self.success = Counter("vllm:request_success", "Finished requests", m + ["finished_reason"], registry=reg)
        t = ["connector", "direction"]
        self.transfer_bytes = Counter("kvrelay:kv_transfer_bytes", "KV bytes moved", t, registry=reg)
        self.transfer_seconds = Histogram("kvrelay:kv_transfer_seconds", "KV transfer duration", t,
                                          buckets=_TRANSFER_BUCKETS, registry=reg)
        self.transfer_failures = Counter("kvrelay:kv_transfer_failures", "KV transfers that failed", t,
                                         registry=reg)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative verifications (draft runs)", m,
                                   registry=reg)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", m,
                                         registry=reg)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", m,
                                     registry=reg)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in their run", m + ["position"],
                                             registry=reg)
        self.cache_info = Gauge("vllm:cache_config_info", "The KV cache's settings, as labels", _CACHE_INFO,
                                registry=reg)
        self.engine_info = Gauge("kvrelay:engine_config_info", "The engine's settings, as labels", _ENGINE_INFO,
                                 registry=reg)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests (adapters as labels)",
                               ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=reg)
        self.lora_loads = Counter("kvrelay:lora_adapter_loads", "LoRA adapters read from their files", registry=reg)
        self.lora_load_seconds = Histogram("kvrelay:lora_adapter_load_seconds", "Time to read and check an adapter",
                                           buckets=_TRANSFER_BUCKETS, registry=reg)
        self.lora_evictions = Counter("kvrelay:lora_adapter_evictions", "LoRA adapters evicted", ["tier"],
                                      registry=reg)
        # Pooling requests (embeddings, scores): their prompts, and the time to their vector; kept out of the
        # generation histograms (TTFT, ITL, e2e), which a pooled request would skew.
        self.pooled = Counter("kvrelay:pooling_requests", "Pooling requests finished (embeddings, scores)", m,
                              registry=reg)
        self.pooled_tokens = Counter("kvrelay:pooled_tokens", "Prompt tokens of pooling requests", m, registry=reg)
        self.pooling_seconds = Histogram("kvrelay:pooling_request_seconds", "Arrival to vector, per pooling request",
                                         m, registry=reg)
        # The host's KV offload tier (kvrelay.engine.offload): this node's blocks through it, and each tier's files.
        self.offload_blocks = Counter("kvrelay:kv_offload_blocks", "KV blocks through the offload tier: offloaded "
                                      "(evicted, queued for the store), dropped (the writer was behind), loaded "
                                      "(instead of computed)", ["event"], registry=reg)
        self.offload_seconds = Counter("kvrelay:kv_offload_engine_seconds", "Engine-thread time on the offload "
                                       "tier: copying evicted blocks out (offload), reading and verifying found ones "
                                       "(fetch), copying them into the KV cache (load)", ["stage"], registry=reg)
        self.offload_tier_blocks = Counter("kvrelay:kv_offload_tier_blocks", "Per tier, by this node: blocks "
                                           "written, hits, misses, evictions, checksum_failures, write_failures",
                                           ["tier", "event"], registry=reg)
        self.offload_tier_written = Counter("kvrelay:kv_offload_written_bytes", "Bytes this node wrote to a tier",
                                            ["tier"], registry=reg)
        self.offload_tier_bytes = Gauge("kvrelay:kv_offload_tier_bytes", "Bytes a tier holds (every node's "
                                        "blocks) as of this node's last write", ["tier"], registry=reg)
        self.offload_token_cost = Gauge("kvrelay:kv_offload_token_cost", "What loading a prompt token from the "
                                        "tier costs as a share of computing one, as this node measured it (routing "
                                        "weighs the tier's tokens by it; 0 until measured)", registry=reg)
        self._last_offload: dict[tuple[str, ...], float] = {}
        self.max_loras = 0
        self._lora_labels: tuple[str, str, str] | None = None
        self._last_lora: tuple[int, int, int] = (0, 0, 0)
        self._last_stats: tuple[float, ...] = (0,) * 8
        self._last_per_pos: list[int] = []
        # Export every series from the start (at 0), as vLLM does: dashboards and rate() need them present.
        for metric in (self.running, self.waiting, self.kv_usage, self.queued_prefill, self.ttft, self.itl,
                       self.e2e, self.cache_hits, self.cache_queries, self.preemptions, self.prompt_tokens,
                       self.generation_tokens, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
            metric.labels(model_name)
        for metric in (self.transfer_bytes, self.transfer_seconds, self.transfer_failures):
            for direction in ("send", "recv"):
                metric.labels(connector, direction)

    def observe_config(self, config, device: str, dtype: str, max_model_len: int, num_blocks: int) -> None:
        """The engine's settings (kvrelay.engine.config.EngineConfig) and what they came to on this machine."""
        c, s = config.cache, config.scheduler
        kv_dtype = dtype if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
        self.cache_info.labels(str(c.block_size), kv_dtype, str(c.enable_prefix_caching),
                               str(c.gpu_memory_utilization), str(num_blocks)).set(1)
        self.engine_info.labels(device, dtype, str(max_model_len), str(s.max_num_seqs), str(s.max_num_batched_tokens),
                                str(config.model.seed), s.policy.value).set(1)
        if config.lora.enable_lora:
            self.max_loras = config.lora.max_loras
            for tier in ("memory", "slot"):
                self.lora_evictions.labels(tier)

    # -- engine thread -------------------------------------------------------------------------------
    def observe_stats(self, load, stats) -> None:
        """After each engine iteration: gauges from the load (kvrelay.common.records.NodeLoad); the engine's
        cumulative counters (EngineCounters) advance by their delta."""
        name = self.model_name
        self.running.labels(name).set(load.num_running)
        self.waiting.labels(name).set(load.num_waiting)
        self.kv_usage.labels(name).set(load.kv_cache_usage)
        self.queued_prefill.labels(name).set(load.queued_prefill_tokens)
        now = (stats.prefix_cache_hits, stats.prefix_cache_queries, stats.num_preemptions, stats.spec_num_drafts,
               stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, stats.images_encoded,
               stats.image_encoder_seconds)
        counters = (self.cache_hits, self.cache_queries, self.preemptions, self.spec_drafts, self.spec_draft_tokens,
                    self.spec_accepted, self.images_encoded, self.image_encoder_seconds)
        for counter, new, old in zip(counters, now, self._last_stats):
            if new > old:
                counter.labels(name).inc(new - old)
        self._last_stats = now
        per_pos = stats.spec_accepted_per_pos
        for pos, count in enumerate(per_pos):
            old = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
            if count > old or pos >= len(self._last_per_pos):
                self.spec_accepted_per_pos.labels(name, str(pos)).inc(count - old)
        self._last_per_pos = list(per_pos)

    def observe_lora(self, running: set[str], waiting: set[str], stats, load_seconds: list[float]) -> None:
        """After each engine iteration with LoRA on (kvrelay.engine.lora.LoRAStats: cumulative)."""
        labels = (",".join(sorted(running)), ",".join(sorted(waiting)), str(self.max_loras))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self.lora_info.remove(*self._lora_labels)
            self.lora_info.labels(*labels).set_to_current_time()
            self._lora_labels = labels
        now = (stats.loads, stats.cpu_evictions, stats.slot_evictions)
        loads, memory, slot = (new - old for new, old in zip(now, self._last_lora))
        if loads:
            self.lora_loads.inc(loads)
        if memory:
            self.lora_evictions.labels("memory").inc(memory)
        if slot:
            self.lora_evictions.labels("slot").inc(slot)
        self._last_lora = now
        for seconds in load_seconds:
            self.lora_load_seconds.observe(seconds)

    def observe_offload(self, report) -> None:
        """After each engine iteration with an offload tier (kvrelay.engine.offload.tier.OffloadReport)."""
        st = report.stats
        self.offload_token_cost.set(report.token_cost)
        now: dict[tuple[str, ...], float] = {
            ("offloaded",): st.offloaded_blocks, ("dropped",): st.dropped_blocks, ("loaded",): st.loaded_blocks,
            ("prefetched",): st.prefetched_blocks,
            ("seconds", "offload"): st.offload_seconds, ("seconds", "fetch"): st.fetch_seconds,
            ("seconds", "load"): st.load_seconds}
        for tier in report.tiers:
            t = tier.stats
            for event in ("writes", "hits", "misses", "evictions", "checksum_failures", "write_failures"):
                now[(tier.name, event)] = getattr(t, event)
            now[(tier.name, "write_bytes")] = t.write_bytes
            self.offload_tier_bytes.labels(tier.name).set(tier.used_bytes)
        for key, value in now.items():
            delta = value - self._last_offload.get(key, 0)
            if delta <= 0 and key in self._last_offload:
                continue
            if key[0] == "seconds":
                self.offload_seconds.labels(key[1]).inc(delta)
            elif len(key) == 1:
                self.offload_blocks.labels(key[0]).inc(delta)
            elif key[1] == "write_bytes":
                self.offload_tier_written.labels(key[0]).inc(delta)
            else:
                self.offload_tier_blocks.labels(*key).inc(delta)
        self._last_offload = now

    def observe_output(self, out, since_arrival: float, last_token_at: float | None, now: float,
                       computes_prompt: bool) -> None:
        """One engine output (kvrelay.engine.scheduler_output.EngineCoreOutput) of a request this node serves."""
        if out.pooled is not None:
            self.prompt_tokens.labels(self.model_name).inc(out.num_prompt_tokens)
            self.pooled.labels(self.model_name).inc()
            self.pooled_tokens.labels(self.model_name).inc(out.num_prompt_tokens)
            self.pooling_seconds.labels(self.model_name).observe(since_arrival)
            return
        if last_token_at is None and computes_prompt:
            self.observe_first_token(since_arrival, out.num_prompt_tokens)
        num_tokens = len(out.new_token_ids) + sum(len(b.token_ids) for b in out.beams)
        self.observe_token(None if last_token_at is None else now - last_token_at, num_tokens)
        if out.finish_reason is not None:
            self.observe_finished(out.finish_reason, since_arrival)

    def observe_first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        self.ttft.labels(self.model_name).observe(seconds)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def observe_token(self, gap_seconds: float | None, num_tokens: int = 1) -> None:
        """An output of `num_tokens` tokens (more than one: accepted drafts); its gap is one ITL sample."""
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        if gap_seconds is not None:
            self.itl.labels(self.model_name).observe(gap_seconds)

    def observe_finished(self, reason: str, seconds: float) -> None:
        self.e2e.labels(self.model_name).observe(seconds)
        self.success.labels(self.model_name, reason).inc()

    # -- transfers (any thread) ----------------------------------------------------------------------
    def observe_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(self.connector, direction).inc(nbytes)
        self.transfer_seconds.labels(self.connector, direction).observe(seconds)

    def observe_transfer_failure(self, direction: str) -> None:
        self.transfer_failures.labels(self.connector, direction).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """GET /metrics (Prometheus text) and GET /health (JSON; 503 while loading, draining or unhealthy)."""

    def __init__(self, host: str, port: int) -> None:
        """Binds the port now (so the node knows its address, and a taken port fails before the model loads)."""
        self._server = ThreadingHTTPServer((host, port), BaseHTTPRequestHandler, bind_and_activate=True)
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(_POLL_S,), name="kvrelay-metrics",
                                        daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start_loading(self) -> None:
        """Serve while the model loads: /health 503 {"status": "loading", "seconds": since}, /metrics 503."""
        since = time.monotonic()

        def health() -> dict:
            return {"healthy": False, "draining": False, "status": "loading", "message": "loading the model",
                    "seconds": round(time.monotonic() - since, 1)}

        self._server.RequestHandlerClass = _make_handler(None, health)
        self._start_thread()

    def start(self, metrics: NodeMetrics, health: Callable[[], dict]) -> None:
        """Serve the node's metrics and health (from here on each request gets the real handler)."""
        self._server.RequestHandlerClass = _make_handler(metrics, health)
        self._start_thread()
        logger.info("metrics on http://%s/metrics (health: /health)", self.address)

    def _start_thread(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()  # returns within _POLL_S
        self._server.server_close()


_POLL_S = 0.1  # how often the server loop looks for shutdown(): close() takes at most this long


def _make_handler(metrics: NodeMetrics | None, health: Callable[[], dict]) -> type[BaseHTTPRequestHandler]:
    """`metrics` None: the node is loading, /metrics has nothing to say yet (503)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            path = self.path.split("?", 1)[0]
            if path == "/metrics" and metrics is None:
                self._reply(503, "text/plain", b"loading the model\n")
            elif path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, metrics.exposition())
            elif path == "/health":
                state = health()
                body = json.dumps(state).encode()
                self._reply(200 if state.get("healthy") and not state.get("draining") else 503,
                            "application/json", body)
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /health\n")

        def _reply(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:  # scrapes every few seconds would flood the log
            logger.debug("metrics http: " + fmt, *args)

    return Handler
