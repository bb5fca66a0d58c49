"""EngineCore: the step loop every node runs. One step is schedule() -> execute() -> update().

Request lifecycle:
1. `add_request` validates (a bad request raises ValueError naming the field, holding nothing) and
   queues it; n > 1 becomes n child requests that share the prompt's blocks through the prefix cache.
2. `step` schedules, runs the model, and turns sampled tokens into EngineCoreOutputs (with speculative
   decoding, an output may carry several tokens: the accepted drafts and one sampled token).
3. A request ends on a stop condition, on max_tokens / max_model_len, or by `abort`; its blocks are
   freed at once (cached ones stay reusable).

A request with structured outputs has its grammar compiled on the GrammarCompiler's threads; until the
compile is done it waits in the scheduler (WAITING_FOR_GRAMMAR) while the others run. A compile that
fails ends the request with "abort". `compile_grammar` may be called from any thread, so a node awaits it
before queueing a request and refuses a bad grammar up front.

Beam search (`add_beam_search`) runs a group of beams under one request id; its one output, at the end,
carries the finished beams.

LoRA (config.lora.enable_lora): a request names its adapter (`lora_name`; "" is the base model), which must be
known to the engine's LoRAManager. Adapters are read off the engine thread (`read_lora`), then registered
(`add_lora`); unloading refuses new requests at once (`begin_unload_lora`) and removes the adapter once no
unfinished request uses it (`lora_in_use`, `remove_lora`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from kvrelay.common.hashing import kv_dtype_key
from kvrelay.common.records import BlockEvent, BlockHash, ImageInput, KVLayout, NodeLoad
from kvrelay.common.sampling_params import BeamSearchParams, PoolingType, SamplingParams, StructuredOutputs
from kvrelay.common.system import TORCH_THP_ENV, huge_pages_for_tensors, keep_freed_memory
from kvrelay.engine.beam_search import BeamGroup, num_candidates
from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.config import EngineConfig, dtype_name
from kvrelay.engine.engine_hooks import BlockEventSink
from kvrelay.engine.image_inputs import checked_images
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.kv_handoff import KVHandoff
from kvrelay.engine.lora import LoRAAdapter, LoRAManager
from kvrelay.engine.model_info import ModelInfo, load_model_info
from kvrelay.engine.model_runner import KVAllocator, KVSender, ModelRunner
from kvrelay.engine.models import MODEL_REGISTRY
from kvrelay.engine.offload import create_offload
from kvrelay.engine.offload import namespace as offload_namespace
from kvrelay.engine.request import KVSendSpec, Request, RequestStatus
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.scheduler_output import EngineCoreOutput, EngineCounters, Reservation
from kvrelay.engine.spec_decode.scheduling import Speculation
from kvrelay.engine.structured import GrammarCompiler, GrammarVocab, create_grammar_compiler
from kvrelay.model_files.vision import VisionSpec

MAX_BEAM_CANDIDATES = 20  # a beam's candidates come back as its row's top logprobs

logger = logging.getLogger(__name__)


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


class EngineCore:
    """`kv_sender` (prefill role): where each layer's KV goes as it is computed; the engine registers its
    caches with it once they exist. `kv_allocator`: allocates the KV caches (a connector that shares them
    with peers through shared memory); None: plain tensors. `record_block_events`: keep the prefix cache's
    STORED/EVICTED events for `drain_block_events` (a node publishes them to the index). `grammars`: the
    grammar compiler (default: one for config.structured, built on first use)."""

    def __init__(
        self, config: EngineConfig, record_block_events: bool = False, kv_sender: KVSender | None = None,
        kv_allocator: KVAllocator | None = None, grammars: GrammarCompiler | None = None,
    ) -> None:
        t0 = time.perf_counter()
        self.info: ModelInfo = load_model_info(config.model)
        # An encoder (bidirectional attention) computes each sequence whole: no chunks, and no prefix cache, whose
        # blocks would hold states that depended on other sequences' later tokens.
        self.encoder = bool(getattr(MODEL_REGISTRY.get(self.info.architecture), "ENCODER", False))
        if self.encoder:
            config = replace(config, scheduler=replace(config.scheduler, enable_chunked_prefill=False),
                             cache=replace(config.cache, enable_prefix_caching=False))
        self.config = config
        if self.info.device.type == "cpu":
            self._tune_cpu_memory()
        self.grammars = grammars or create_grammar_compiler(config.structured, self._grammar_vocab)
        self.lora = LoRAManager(config.lora, self._loras_in_use) if config.lora.enable_lora else None
        self.runner = ModelRunner(config, self.info, kv_sender, kv_allocator, self.grammars, self.lora)
        self.vocab_size = self.runner.vocab_size
        self.classifier = self.info.architecture.endswith("ForSequenceClassification")  # it scores, never generates
        self.num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(self.num_blocks)
        if kv_sender is not None:
            kv_sender.register_kv_caches(self.kv_layout(), self.runner.kv_caches)
        block_size = config.cache.block_size
        capacity = self.num_blocks * block_size
        self.max_model_len = self._max_model_len(capacity)
        self.runner.capture_graphs(self.max_model_len)
        weights = [self.info.path, *([self.info.gguf_path] if self.info.gguf_path else [])]
        if config.speculative is not None and config.speculative.model:  # its KV travels with the target's
            weights.append(config.speculative.model)
        block_bytes = self.runner.bytes_per_block
        self.offload = create_offload(config.cache, offload_namespace(self.kv_layout(), weights, block_bytes),
                                      self.runner, block_bytes)
        pool = BlockPool(self.num_blocks, config.cache.enable_prefix_caching, record_events=record_block_events,
                         on_evict=self.offload.offload if self.offload is not None else None)
        self.kv = KVCacheManager(pool, block_size, self.info.model_id, config.cache.enable_prefix_caching,
                                 kv_dtype_key(config.cache.kv_cache_dtype), tier=self.offload)
        self.handoff = KVHandoff(self.kv)
        speculation = Speculation.create(config.speculative, config.scheduler, self.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, speculation, self.handoff,
                                   max_loras=config.lora.max_loras if self.lora is not None else 0,
                                   generates=not (self.encoder or self.classifier))
        if self.lora is not None:
            self.lora.load_modules()
        self._compiling: dict[str, concurrent.futures.Future] = {}  # request id -> its grammar's compile
        logger.info(
            "engine ready in %.1fs: %s (%s, %s), KV cache %d blocks x %d tokens = %d tokens (%.1f MiB, %s), "
            "max_model_len %d",
            time.perf_counter() - t0, self.info.model_id, self.info.dtype, self.info.device,
            self.num_blocks, block_size, capacity, self.num_blocks * self.runner.bytes_per_block / 2**20,
            dtype_name(self.runner.kv_dtype), self.max_model_len,
        )

    @staticmethod
    def _tune_cpu_memory() -> None:
        # Both before the model loads: what torch allocates from here on follows them.
        if not keep_freed_memory():
            logger.info("not glibc: activations freed each step may be page-faulted back in (slower on CPU)")
        if not huge_pages_for_tensors():
            logger.info("no transparent huge pages for tensors (THP off here or %s=0): more TLB misses walking "
                        "weights and KV", TORCH_THP_ENV)

    def _max_model_len(self, capacity: int) -> int:
        limit = self.config.model.max_model_len or self.info.max_position_embeddings
        if limit > self.info.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {limit} exceeds the model's context length {self.info.max_position_embeddings}"
            )
        sched = self.config.scheduler
        if self.encoder and sched.max_num_batched_tokens < limit:  # a sequence is one step: no longer than one
            logger.warning("max_model_len %d exceeds max_num_batched_tokens, and an encoder computes a sequence in "
                           "one step; capping at %d tokens", limit, sched.max_num_batched_tokens)
            limit = sched.max_num_batched_tokens
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < limit:
            raise ValueError(
                f"max_num_batched_tokens: {sched.max_num_batched_tokens} is smaller than max_model_len {limit}; "
                "without chunked prefill a longer prompt could never be scheduled"
            )
        if limit > capacity:
            logger.warning("max_model_len %d exceeds the KV cache capacity; capping at %d tokens", limit, capacity)
            limit = capacity
        return limit

    # -- requests -------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt: must not be empty")
        for t in prompt_token_ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        classify = params.pooling is not None and params.pooling.pooling_type == PoolingType.CLASSIFY
        if self.encoder and (params.pooling is None or classify):
            raise ValueError(f"pooling: {self.info.architecture} is an encoder; it takes embedding requests only "
                             "(last, mean or cls pooling)")
        if self.classifier != classify:
            raise ValueError(f"pooling: {self.info.architecture} scores sequences with its classification head; it "
                             "takes classify pooling requests only (/v1/score, /v1/rerank)" if self.classifier else
                             f"pooling: classify needs a sequence classifier; {self.info.architecture} is not one")
        if params.pooling is not None:  # nothing is generated: the prompt may fill the context
            if len(prompt_token_ids) > self.max_model_len:
                raise ValueError(f"prompt: {len(prompt_token_ids)} tokens exceed max_model_len {self.max_model_len}")
        elif len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within max_model_len "
                f"{self.max_model_len}"
            )
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad} outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:8]} outside the vocabulary [0, {self.vocab_size})")
        if params.num_resumed_tokens >= len(prompt_token_ids):
            raise ValueError(f"num_resumed_tokens: {params.num_resumed_tokens} leaves no prompt of the "
                             f"{len(prompt_token_ids)} tokens")

    @property
    def vision(self) -> VisionSpec | None:
        """How this model takes images (None: it takes none)."""
        return self.runner.vision

    def check_images(self, prompt: Sequence[int], images: Sequence[ImageInput], decode: bool = True
                     ) -> tuple[ImageInput, ...]:
        """The prompt's images with their content hashes; ValueError for images it cannot take (image_inputs.py)."""
        return checked_images(self.runner.vision, self.info.architecture, prompt, images, decode)

    def check_lora(self, lora_name: str) -> None:
        """UnknownAdapter unless a request may run with `lora_name` here ("" always may)."""
        if not lora_name:
            return
        if self.lora is None:
            from kvrelay.engine.lora import UnknownAdapter

            raise UnknownAdapter(f"The model `{lora_name}` does not exist: this engine runs no LoRA adapters "
                                 "(--enable-lora)")
        self.lora.check(lora_name)

    # -- LoRA adapters --------------------------------------------------------------------------------

    def read_lora(self, name: str, path: str) -> LoRAAdapter:
        """An adapter read and checked against this model (AdapterError when malformed). Any thread: nothing in
        the engine changes; `add_lora` registers it."""
        if self.lora is None:
            from kvrelay.engine.lora import AdapterError

            raise AdapterError("LoRA adapters are not enabled on this engine (--enable-lora)")
        return self.lora.read(name, path)

    def add_lora(self, name: str, adapter: LoRAAdapter) -> None:
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled on this engine (--enable-lora)")
        self.lora.register(name, adapter)

    def begin_unload_lora(self, name: str) -> None:
        """New requests for `name` are refused from now on (UnknownAdapter if it is not loaded)."""
        self.check_lora(name)  # raises for an unknown name, or without LoRA
        self.lora.begin_unload(name)

    def remove_lora(self, name: str) -> bool:
        return self.lora is not None and self.lora.remove(name)

    def lora_in_use(self, name: str) -> int:
        """Unfinished requests (reservations included) running with adapter `name`."""
        return sum(1 for req in self._unfinished_requests() if req.lora_name == name)

    def lora_requests(self) -> tuple[set[str], set[str]]:
        """(adapters of running requests, adapters of waiting ones): vLLM's lora_requests_info."""
        running = {r.lora_name for r in self.scheduler.running if r.lora_name}
        waiting = {r.lora_name for r in self._unfinished_requests()
                   if r.lora_name and r.status != RequestStatus.RUNNING}
        return running, waiting

    def _unfinished_requests(self):
        yield from self.scheduler.requests.values()
        for item in self.handoff.queued:
            yield item.req

    def _loras_in_use(self) -> set[str]:
        return {r.lora_name for r in self._unfinished_requests() if r.lora_name}

    def compile_grammar(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        """The grammar's compile (cached per spec), off the step loop; its result raises ValueError for a bad
        schema, regex or grammar. Thread-safe."""
        return self.grammars.submit(spec)

    def warm_up_grammars(self) -> None:
        """Build the grammar backend now, in the background (else on the first constrained request)."""
        self.grammars.warm_up()

    def _grammar_vocab(self) -> GrammarVocab:
        # A finished grammar allows the model's end tokens only: the request then stops as usual.
        eos = () if self.info.eos_token_id is None else (self.info.eos_token_id,)
        stops = tuple(dict.fromkeys((*eos, *self.info.extra_eos_token_ids)))
        return GrammarVocab(str(self.info.path), self.vocab_size, stops)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str = "",
        kv_send: KVSendSpec | None = None,
        lora_name: str = "",
        images: Sequence[ImageInput] = (),
    ) -> list[str]:
        """Queue a request; returns the engine request ids (one, or n children for n > 1).
        With `kv_send` (prefill role) the request computes its prompt, samples one token, and its prompt
        KV goes to the peer layer by layer as it is computed. `lora_name`: its adapter ("": the base model).
        `images`: the prompt's images at their placeholder tokens (a vision-language model)."""
        prompt = list(prompt_token_ids)
        self.validate(prompt, params)
        images = self.check_images(prompt, images)
        self.check_lora(lora_name)
        self.scheduler.check_room_to_wait(1 if kv_send is not None else params.n)
        if kv_send is not None:
            if params.pooling is not None:
                raise ValueError("pooling: a pooling request runs where its prompt is computed; it is not handed off")
            req = self._make_request(request_id, prompt, params.for_child(0), arrival_time, cache_salt, lora_name,
                                     images)
            req.kv_send, req.max_tokens = kv_send, req.num_resumed_tokens + 1
            self._queue(req)
            return [request_id]
        if params.n == 1:
            self._queue(self._make_request(request_id, prompt, params, arrival_time, cache_salt, lora_name, images))
            return [request_id]
        ids = [child_request_id(request_id, i) for i in range(params.n)]
        for i, rid in enumerate(ids):
            self._queue(self._make_request(rid, prompt, params.for_child(i), arrival_time, cache_salt, lora_name,
                                           images))
        return ids

    def add_beam_search(
        self, request_id: str, prompt_token_ids: Sequence[int], params: BeamSearchParams,
        arrival_time: float | None = None, cache_salt: str = "", lora_name: str = "",
    ) -> None:
        """Queue a beam search; its one output (at the end) carries the finished beams, best first."""
        prompt = list(prompt_token_ids)
        self.validate(prompt, SamplingParams())
        self.check_lora(lora_name)
        end_ids = () if params.ignore_eos or self.info.eos_token_id is None else (
            self.info.eos_token_id, *self.info.extra_eos_token_ids)
        candidates = num_candidates(params.beam_width, len(end_ids))
        if candidates > MAX_BEAM_CANDIDATES:
            raise ValueError(f"beam_width: at most {MAX_BEAM_CANDIDATES // max(2, 1 + len(end_ids))} for this "
                             f"model (each beam ranks its top {max(2, 1 + len(end_ids))} x beam_width tokens)")
        if params.beam_width > self.config.scheduler.max_num_seqs:
            raise ValueError(f"beam_width: {params.beam_width} exceeds max_num_seqs "
                             f"{self.config.scheduler.max_num_seqs}")
        max_new = min(params.max_tokens, self.max_model_len - len(prompt))
        bs = self.config.cache.block_size
        if params.beam_width * -(-(len(prompt) + max_new) // bs) > self.num_blocks:
            raise ValueError(f"beam_width: {params.beam_width} beams of up to {len(prompt) + max_new} tokens may "
                             f"need more than the {self.num_blocks} KV blocks this engine has")
        root = SamplingParams(temperature=0.0, max_tokens=None, logprobs=candidates, ignore_eos=True)
        req = Request(f"{request_id}:beam0", prompt, root, eos_token_id=None, cache_salt=cache_salt,
                      lora_name=lora_name)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        group = BeamGroup(request_id, params, len(prompt), end_ids, max_new)
        self.scheduler.add_beam_group(group, req)

    def _queue(self, req: Request) -> None:
        spec = req.sampling_params.structured_outputs
        future = None if spec is None else self.compile_grammar(spec)
        if future is not None and future.done() and future.exception() is not None:
            raise future.exception()  # a grammar already known to be bad: refuse it like any bad field
        if future is not None and not future.done():
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add_request(req)
        if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self._compiling[req.request_id] = future

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Release the requests whose grammar compiled; end those whose compile failed."""
        failed = []
        for rid, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            if future.exception() is None:
                self.scheduler.grammar_ready(rid)
                continue
            logger.warning("request %s: %s", rid, future.exception())
            for req in self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED):
                failed.append(EngineCoreOutput(rid, (), None, "abort", None, req.num_prompt_tokens, 0))
        return failed

    def _make_request(
        self, rid: str, prompt: list[int], params: SamplingParams, arrival: float | None, salt: str,
        lora_name: str = "", images: tuple[ImageInput, ...] = (),
    ) -> Request:
        extra = [t for t in self.info.extra_eos_token_ids if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            params = replace(params, stop_token_ids=(*params.stop_token_ids, *extra))
        req = Request(rid, prompt, params, eos_token_id=self.info.eos_token_id, cache_salt=salt, lora_name=lora_name,
                      images=images)
        if arrival is not None:
            req.arrival_time = arrival
        room = self.max_model_len - len(prompt) + params.num_resumed_tokens  # resumed output counts as output
        req.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return req

    # -- disaggregation -------------------------------------------------------------------------------

    def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        lease_s: float | None = None, cache_salt: str = "", queue_until: float | None = None, lora_name: str = "",
        images: Sequence[ImageInput] = (),
    ) -> Reservation | None:
        """Decode role: blocks for a prompt a prefill node will compute. None: no room now, and either
        refused or (with `queue_until`, a monotonic time) queued for blocks: `is_queued`, then
        `admit_queued_reservations`."""
        prompt = list(prompt_token_ids)
        self.validate(prompt, params)
        if params.n != 1:
            raise ValueError("n: a reservation is for one sequence; reserve each of n separately")
        self.check_lora(lora_name)
        # Hashed, not decoded: the prefill node decodes them (and this node only if it recomputes the prompt).
        images = self.check_images(prompt, images, decode=False)
        req = self._make_request(request_id, prompt, params, None, cache_salt, lora_name, images)
        lease = self.config.scheduler.kv_lease_s if lease_s is None else lease_s
        return self.scheduler.reserve(req, lease, queue_until)

    def is_queued(self, request_id: str) -> bool:
        return request_id in self.handoff.queued

    def has_queued_reservations(self) -> bool:
        return bool(len(self.handoff.queued))

    def admit_queued_reservations(self) -> tuple[list[Reservation], list[str]]:
        """(reservations granted now, in arrival order; ids whose wait ran out)."""
        return self.scheduler.admit_queued()

    def admit_reserved(self, request_id: str, first_token: int, logprobs=None) -> EngineCoreOutput:
        """Decode role: the reserved blocks hold the prompt's KV; decode on from `first_token`."""
        if not 0 <= first_token < self.vocab_size:
            raise ValueError(f"first_token_id: {first_token} is outside the vocabulary [0, {self.vocab_size})")
        return self.scheduler.admit_reserved(request_id, first_token, logprobs)

    def release_held(self, request_id: str) -> bool:
        """Prefill role: the transfer reading this request's blocks is over; free them."""
        return self.scheduler.release_held(request_id)

    def expire_leases(self) -> list[str]:
        return self.scheduler.expire_leases()

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort requests (a beam search by its id); returns the ids that were unfinished."""
        for rid in request_ids:
            self._compiling.pop(rid, None)
        groups = self.scheduler.abort_beam_groups(request_ids)
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return groups + [r.request_id for r in done]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_leases(self) -> bool:
        return self.handoff.has_leases()

    # -- what callers may ask ---------------------------------------------------------------------------

    def kv_layout(self) -> KVLayout:
        """The cache's layout; its model names the weights' form too: KV computed from GGUF blocks differs from
        the dense weights' a little, so a transfer between the two is refused like any layout mismatch."""
        weights = "" if self.info.quantization is None else f" ({self.info.quantization} weights)"
        return KVLayout.for_caches(self.info.model_id + weights, self.runner.kv_caches)

    def load(self) -> NodeLoad:
        load = self.scheduler.load()
        if self.offload is not None:
            load = replace(load, kv_tier_token_cost=self.offload.token_cost())
        if self.lora is None:
            return load
        names = self.lora.names()
        return replace(load, lora_adapters=tuple(names), lora_paths=tuple(self.lora.paths[n] for n in names),
                       lora_resident=tuple(self.lora.cached), lora_capacity=self.config.lora.cpu_capacity)

    def counters(self) -> EngineCounters:
        """Cumulative prefix-cache, preemption and image-encoder counts (the metrics advance by their deltas)."""
        counters = self.scheduler.counters
        stats = self.runner.image_stats()
        if stats is not None:
            counters.images_encoded, counters.image_encoder_seconds = stats.images_encoded, stats.encoder_seconds
        return counters

    def cached_block_hashes(self) -> list[BlockHash]:
        return list(self.kv.pool.cached)

    def drain_block_events(self) -> list[BlockEvent]:
        """STORED/EVICTED events since the last call, in order (empty unless record_block_events)."""
        return self.kv.pool.drain_events() if self.kv.pool.record_events else []

    def request_ids(self, computing_only: bool = False) -> list[str]:
        """Unfinished requests (reservations included; a beam search by its id); computing_only: those a
        step may be running."""
        reqs = self.scheduler.requests
        ids = [r.beam_group or rid for rid, r in reqs.items() if not computing_only or r.status.computing]
        ids = list(dict.fromkeys(ids))
        return ids if computing_only else ids + self.handoff.queued.ids()

    def held_request_ids(self) -> list[str]:
        return list(self.handoff.held)

    def token_counts(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens, prefix-cache hit tokens) of an unfinished request, or None."""
        group = self.scheduler.beam_groups.get(request_id)
        if group is not None:
            root = group.beams[0].req
            return root.num_prompt_tokens, root.num_cached_tokens or 0
        req = self.scheduler.requests.get(request_id)
        return None if req is None else (req.num_prompt_tokens, req.num_cached_tokens or 0)

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        if self.handoff.has_leases():
            self.scheduler.expire_leases()
        failed = self._poll_grammars() if self._compiling else []
        sched = self.scheduler.schedule()
        if sched.is_empty and self._compiling and not failed:
            # Only compiles to wait for: sleep on them rather than spin.
            concurrent.futures.wait(list(self._compiling.values()), timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        if self.offload is None:
            result = self.runner.execute(sched)
        else:  # its loads are weighed against what computing a token costs here
            t0 = time.perf_counter()
            result = self.runner.execute(sched)
            self.offload.observe_step(sched.total_num_scheduled_tokens, time.perf_counter() - t0)
        return failed + self.scheduler.update_from_output(sched, result)

    def offload_tier_ids(self) -> dict[str, str]:
        """Each offload tier's entry in the block index, by tier name ({} without a tier)."""
        return self.offload.tier_ids() if self.offload is not None else {}

    def publish_tiers(self, sinks: Mapping[str, BlockEventSink]) -> None:
        """Keep each tier's index entry (`offload_tier_ids`) told what the tier holds, from its writer thread."""
        if self.offload is not None:
            self.offload.publish_to(sinks)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self.offload is not None:
            self.offload.flush()
            self.offload.close()
