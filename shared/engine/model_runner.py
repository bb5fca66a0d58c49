"""Model runner: turns a SchedulerOutput into one flat forward pass and samples. No policy lives here.

Per-request state lifecycle:
1. A NewRequestData creates (or, after preemption, recreates) the request's state: tokens, block ids.
2. Each CachedRequestData appends the step's new block ids.
3. After the forward, rows whose computed tokens reach the end of their known tokens sample one token,
   which is appended to the state. With speculative decoding such a request also carries the drafts the
   scheduler passed on: the target's logits at its last known token and at each draft verify them
   (spec_decode.verify), the accepted drafts and one sampled token are appended, and the proposer drafts
   the next ones for the requests the scheduler names.
4. Finished and preempted ids drop the state.

Structured outputs: a constrained request's state holds a grammar matcher. It is built with the state from
the grammar's source (compiled by the engine's GrammarCompiler) and replays the output tokens the request
already has: after a preemption, on a decode node taking over from a prefill node (the first token), or on
a node a request migrated to. Before each sample it fills the request's bitmask row; the sampled token
advances it. (The scheduler never gives a constrained request drafts.)

Block copies the scheduler orders (copy-on-write of a beam's shared block) run before the forward pass.

LoRA: a request's state names its adapter. Each step the runner asks its `LoRASlots` (the engine's LoRAManager,
which decides what sits in which slot) for the per-row slots of the step's adapters, and passes them to the
model's forward; rows of the base model and of different adapters run in the same batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from kvrelay.common.kv_allocator import KVAllocator
from kvrelay.common.records import KVLayout, TokenLogprobs, kv_cache_shape
from kvrelay.common.sampling_params import PoolingType, SamplingParams
from kvrelay.engine import host_memory
from kvrelay.engine.attention import get_attention_backend
from kvrelay.engine.attention.base import cache_row
from kvrelay.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, kv_cache_torch_dtype
from kvrelay.engine.cuda_graphs import DecodeGraphs, capture_sizes
from kvrelay.engine.image_inputs import ImageEncoder, ImageStats
from kvrelay.engine.lora.layers import LoRABatch
from kvrelay.engine.model_info import ModelInfo
from kvrelay.engine.models.loader import load_model
from kvrelay.engine.pooling import Pooler
from kvrelay.engine.sampler import Sampler, SamplerOutput, SamplingRow, TokenBitmask, TokenSpan
from kvrelay.engine.scheduler_output import KVSend, ModelRunnerOutput, SchedulerOutput
from kvrelay.engine.spec_decode import Draft, ProposeRequest, Verified, Verifier, VerifyGroup, create_proposer
from kvrelay.engine.step_batch import RequestState, StepBatch, build_batch
from kvrelay.engine.structured import GrammarCompiler, GrammarMatcher, bitmask_words
from kvrelay.model_files.vision import vision_spec

logger = logging.getLogger(__name__)

_CUDA_ACTIVATION_RESERVE = 2 * 1024**3
_PROMPT_LOGPROBS_ROWS = 256  # prompt positions per logits slice (bounds the [rows, vocab] buffers)


class KVSender(Protocol):
    """Where a prefill node's KV goes (a kv_transfer connector): the engine registers its caches once, and
    the runner enqueues each layer's blocks as soon as the layer is written."""

    def register_kv_caches(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None: ...

    def send_blocks(self, peer: str, transfer_id: str, layer: int, src: list[int], dst: list[int]) -> None: ...


class LoRASlots(Protocol):
    """Where a step's LoRA adapters sit (kvrelay.engine.lora.LoRAManager): it gives the model's projections their
    slots once, and each step the slot of every row."""

    def attach(self, model) -> None: ...

    def batch(self, row_adapters: Sequence[str], row_counts: Sequence[int]) -> LoRABatch | None: ...


class ModelRunner:
    """`kv_allocator`: allocates the KV caches (None: plain tensors); `grammars`: where constrained requests'
    grammars come from (None: structured outputs refused); `lora`: where LoRA adapters sit (None: no adapters)."""

    def __init__(
        self, config: EngineConfig, info: ModelInfo, kv_sender: KVSender | None = None,
        kv_allocator: KVAllocator | None = None, grammars: GrammarCompiler | None = None,
        lora: LoRASlots | None = None,
    ) -> None:
        self.config = config
        self.info = info
        self.device = info.device
        self.dtype = info.dtype
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, info.dtype)  # the KV cache's
        self.block_size = config.cache.block_size
        self.attn = get_attention_backend(config.model.attention_backend, self.device)
        self.model = load_model(info.path, self.dtype, self.device, self.attn, gguf_blocks=info.gguf_path,
                                quantization=info.quantization)
        self.kv_row = cache_row(self.model.head_size, self.kv_dtype)  # elements per head row of the cache
        # A vision-language model: its image spec, and the encoder that fills image placeholders with features.
        self.vision = vision_spec(info.path) if hasattr(self.model, "encode_images") else None
        self.images = None if self.vision is None else ImageEncoder(self.model, self.vision, self.device)
        self.lora = lora
        if lora is not None:
            lora.attach(self.model)
        self.vocab_size = self.model.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device, seed=config.model.seed)
        self.verifier = Verifier(self.sampler, config.model.seed, self.device)
        self.proposer = (create_proposer(config, self.vocab_size, self.dtype, self.device)
                         if config.speculative is not None else None)
        self.drafts: dict[str, Draft] = {}  # proposed last step, verified when scheduled
        self.kv_caches: list[torch.Tensor] = []
        self.states: dict[str, RequestState] = {}
        self.pooler = Pooler()  # embedding requests' partial sums (kvrelay.engine.pooling)
        self.kv_sender = kv_sender
        self.grammars = grammars
        self._bitmask: torch.Tensor | None = None  # int32 [rows, words], reused every step
        self.kv_allocator = kv_allocator
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps (capture_graphs)

    def image_stats(self) -> ImageStats | None:
        """Images encoded here and the time it took (None: the model takes no images)."""
        return None if self.images is None else self.images.stats

    # -- KV cache ----------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        draft = self.proposer.kv_bytes_per_block if self.proposer is not None else 0
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * self.kv_row * elem + draft

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda" and cache.kv_cache_memory is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = total * cache.gpu_memory_utilization - torch.cuda.memory_allocated(self.device)
            budget -= _CUDA_ACTIVATION_RESERVE
        else:
            budget = cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {int(budget)} bytes hold no KV block ({self.bytes_per_block} bytes each)"
            )
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads, self.kv_row)
        if self.kv_allocator is not None:
            self.kv_caches = self.kv_allocator.allocate_kv_caches(m.num_layers, shape, self.kv_dtype, self.device)
        else:
            self.kv_caches = [host_memory.zeros(shape, self.kv_dtype, self.device) for _ in range(m.num_layers)]
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)

    def capture_graphs(self, max_model_len: int) -> None:
        """On CUDA, capture decode steps of up to max_num_seqs rows and max_model_len tokens (kvrelay.engine.
        cuda_graphs), unless the config says enforce_eager or the attention backend cannot be captured."""
        if self.device.type != "cuda" or self.config.model.enforce_eager:
            return
        if not self.attn.graph_safe(self.dtype, self.kv_dtype):
            logger.info("no CUDA graphs: the %s attention backend runs %s over a %s cache eagerly", self.attn.name,
                        self.dtype, self.kv_dtype)
            return
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, capture_sizes(self.config.scheduler.max_num_seqs),
                                   max_blocks, self.block_size)
        self.graphs.capture()

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        draft = self.proposer.kv_caches if self.proposer is not None else []
        for cache in [*self.kv_caches, *draft]:
            if cache.element_size() == 1:  # fp8: torch has no index_copy_ for it, so the bytes move
                cache = cache.view(torch.uint8)
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def _block_views(self) -> list[torch.Tensor]:
        """Every cache (a draft model's after the target's) as [2, blocks, words]: a block's keys, or values, as
        one run of 8-byte words (of bytes where a block's size is not a multiple of 8): whole-word copies, and fp8,
        which has no index ops, moves as well."""
        draft = self.proposer.kv_caches if self.proposer is not None else []
        flats = [c.view(torch.uint8).reshape(2, c.shape[1], -1) for c in [*self.kv_caches, *draft]]
        if all(f.shape[-1] % 8 == 0 for f in flats):  # all or none: a payload's words must stay aligned
            return [f.view(torch.int64) for f in flats]
        return flats

    def read_blocks(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Each block's KV as one run of bytes: every layer's keys then values (a draft model's after the
        target's), the offload tier's payload."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        parts = [v.index_select(1, ids).transpose(0, 1).reshape(len(block_ids), -1).view(torch.uint8)
                 for v in self._block_views()]
        rows = torch.cat(parts, dim=1).cpu().numpy()
        return [memoryview(row) for row in rows]

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence) -> None:
        """The inverse of read_blocks: payloads of that form into `block_ids`."""
        n = len(block_ids)
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        data = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for p in payloads]).to(self.device)
        offset = 0
        for view in self._block_views():
            size = 2 * view.shape[-1] * view.element_size()
            part = data[:, offset:offset + size].view(view.dtype).reshape(n, 2, -1).transpose(0, 1)
            view.index_copy_(1, ids, part)
            offset += size

    # -- step ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        if sched.is_empty:
            return ModelRunnerOutput()
        batch = self._prepare(sched)
        on_layer_done = self._layer_sender(sched.kv_sends) if sched.kv_sends else None
        hidden = self._forward(batch, on_layer_done)
        self._prompt_logprobs(batch, hidden)
        pooled = self._pool(batch, hidden)
        if not batch.sample_req_ids:
            return ModelRunnerOutput(pooled=pooled)
        if any(sched.scheduled_spec_tokens.get(rid) for rid in batch.sample_req_ids):
            verified = self._verify(sched, hidden[batch.logits_indices], batch.sample_req_ids)
        else:
            out = self._sample(hidden[batch.logits_indices], batch.sample_req_ids)
            verified = {rid: Verified((token,), () if lp is None else (lp,))
                        for rid, token, lp in zip(batch.sample_req_ids, out.token_ids, out.logprobs)}
        sampled, logprobs, prompt_logprobs = {}, {}, {}
        for rid, v in verified.items():
            st = self.states[rid]
            if st.prompt_logprobs is not None and len(st.token_ids) == st.num_prompt_tokens:
                prompt_logprobs[rid] = (None, *st.prompt_logprobs)  # the first token has no context
            st.token_ids.extend(v.token_ids)
            sampled[rid] = v.token_ids
            if v.logprobs:
                logprobs[rid] = v.logprobs
            if st.matcher is not None and not all(st.matcher.accept(t) for t in v.token_ids):
                logger.error("request %s: sampled tokens %s leave its grammar; it goes on unconstrained",
                             rid, v.token_ids)
                st.matcher = None
        drafts = self._propose(sched, sampled)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, spec_token_ids=drafts,
                                 prompt_logprobs=prompt_logprobs, pooled=pooled)

    def _forward(self, batch: StepBatch, on_layer_done) -> torch.Tensor:
        """The step's hidden states: a captured graph's replay for a decode-only step that has one, else eager."""
        if self.graphs is not None and on_layer_done is None and batch.lora is None and batch.embeds_at is None:
            size = self.graphs.size_for(len(batch.req_ids), batch.meta)
            if size is not None:
                return self.graphs.replay(size, batch.input_ids, batch.positions, batch.meta)
        args = (batch.input_ids, batch.positions, self.kv_caches, batch.meta, on_layer_done, batch.lora)
        # Image features only where a step holds image positions (the other models take no such argument).
        return self.model(*args) if batch.embeds_at is None else self.model(*args, embeds_at=batch.embeds_at)

    def _verify(self, sched: SchedulerOutput, hidden: torch.Tensor, req_ids: list[str]) -> dict[str, Verified]:
        """A step with drafts: every row's logits (a draft's row scores the position after it); rows of
        requests without drafts sample as usual, grammar masks included."""
        rows, groups, row_req_ids = [], [], []
        for rid in req_ids:
            drafts = sched.scheduled_spec_tokens.get(rid, ())
            groups.append(VerifyGroup(rid, len(rows), drafts, self._draft_probs(rid, drafts)))
            new_rows = self._sampling_rows(rid, drafts)
            rows.extend(new_rows)
            row_req_ids.extend([rid] * len(new_rows))
        bitmask = self._grammar_bitmask(row_req_ids)
        return self.verifier(self.model.compute_logits(hidden), rows, groups, bitmask)

    def _draft_probs(self, rid: str, drafts: tuple[int, ...]) -> torch.Tensor | None:
        draft = self.drafts.pop(rid, None)
        if not drafts or draft is None or draft.probs is None:
            return None
        if draft.token_ids[: len(drafts)] != drafts:
            raise RuntimeError(f"request {rid}: scheduled drafts {drafts} are not the ones proposed")
        return draft.probs[: len(drafts)]

    def _propose(self, sched: SchedulerOutput, sampled: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        if self.proposer is None or not sched.propose_req_ids:
            return {}
        reqs = []
        for rid in sched.propose_req_ids:
            if rid in sampled:
                st = self.states[rid]
                reqs.append(ProposeRequest(rid, st.token_ids, st.num_prompt_tokens, st.params, st.block_ids))
        drafts = self.proposer.propose(reqs)
        self.drafts.update(drafts)
        return {rid: d.token_ids for rid, d in drafts.items() if d.token_ids}

    # -- structured outputs and prompt logprobs ------------------------------------------------------

    def _grammar_bitmask(self, sample_req_ids: list[str]) -> TokenBitmask | None:
        rows = [(i, st.matcher) for i, rid in enumerate(sample_req_ids)
                if (st := self.states[rid]).matcher is not None and not st.matcher.is_terminated()]
        if not rows:
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            size = max(len(rows), self.config.scheduler.max_num_seqs)
            self._bitmask = torch.zeros(size, bitmask_words(self.vocab_size), dtype=torch.int32)
        for j, (_, matcher) in enumerate(rows):
            matcher.fill_bitmask(self._bitmask, j)
        return TokenBitmask([i for i, _ in rows], self._bitmask[: len(rows)])

    def _new_matcher(self, rid: str, params: SamplingParams, outputs: list[int]) -> GrammarMatcher | None:
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.grammars is None:
            raise ValueError("structured_outputs: this engine has no grammar backend")
        matcher = self.grammars.get(spec).matcher()
        for token in outputs:  # a request rebuilt here replays what it generated elsewhere or before
            if not matcher.accept(token):
                logger.error("request %s: output token %d does not replay in its grammar; unconstrained", rid, token)
                return None
        return matcher

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> None:
        """Each prompt token's logprob given the tokens before it, for requests that asked (positions this
        step computed; a request's prompt is never a prefix-cache hit, so every position is computed)."""
        for i, rid in enumerate(batch.req_ids):
            st = self.states[rid]
            if st.prompt_logprobs is None or len(st.token_ids) > st.num_prompt_tokens:
                continue
            start = batch.starts[i]
            end = min(start + batch.meta.query_lens_cpu[i], st.num_prompt_tokens - 1)
            for lo in range(start, end, _PROMPT_LOGPROBS_ROWS):
                hi = min(lo + _PROMPT_LOGPROBS_ROWS, end)
                at = batch.offsets[i] + lo - start
                logits = self.model.compute_logits(hidden[at : at + hi - lo])[:, : self.vocab_size].float()
                targets = st.token_ids[lo + 1 : hi + 1]
                st.prompt_logprobs.extend(_token_logprobs(logits, targets, st.params.prompt_logprobs or 0))

    def _pool(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, tuple[float, ...]]:
        """Pooling requests' rows to the pooler; the vectors of those whose prompts this step completes."""
        for i in batch.pooling:
            rid = batch.req_ids[i]
            rows = hidden[batch.offsets[i] : batch.offsets[i] + batch.meta.query_lens_cpu[i]]
            self.pooler.observe(rid, self.states[rid].params.pooling, rows, batch.starts[i])
        out = {}
        for rid, row in batch.pool_rows.items():
            st = self.states[rid]
            last = hidden[row]
            if st.params.pooling.pooling_type == PoolingType.CLASSIFY:
                last = self.model.classify(last)
            out[rid] = self.pooler.finish(rid, st.params.pooling, last, st.num_prompt_tokens)
        return out

    def _sample(self, hidden: torch.Tensor, req_ids: list[str]) -> SamplerOutput:
        """Rows the sampler needs only the argmax of skip their logits (the sampler says which); a step of only
        such rows makes no SamplingRow at all."""
        if all(self._argmax_only(rid) for rid in req_ids):
            return SamplerOutput(self.model.greedy_tokens(hidden).tolist(), [None] * len(req_ids))
        rows = [self._sampling_rows(rid)[0] for rid in req_ids]
        plain = [self.sampler.argmax_only(r) for r in rows]
        if not any(plain):
            return self.sampler(self.model.compute_logits(hidden), rows, self._grammar_bitmask(req_ids))
        fancy = [i for i, p in enumerate(plain) if not p]
        greedy = [i for i, p in enumerate(plain) if p]
        out = self.sampler(self.model.compute_logits(hidden[fancy]), [rows[i] for i in fancy],
                           self._grammar_bitmask([req_ids[i] for i in fancy]))
        tokens, logprobs = [0] * len(rows), [None] * len(rows)
        for i, token in zip(greedy, self.model.greedy_tokens(hidden[greedy]).tolist()):
            tokens[i] = token
        for i, token, lp in zip(fancy, out.token_ids, out.logprobs):
            tokens[i], logprobs[i] = token, lp
        return SamplerOutput(tokens, logprobs)

    def _layer_sender(self, sends: tuple[KVSend, ...]):
        if self.kv_sender is None:
            raise RuntimeError("kv_sends scheduled but the engine was built without a KV sender")
        sender = self.kv_sender
        blocks = [(s, list(s.src_block_ids), list(s.dst_block_ids)) for s in sends]  # every layer's, made once

        def send_layer(layer: int) -> None:
            # send_blocks only enqueues: the connector's thread moves the bytes while later layers compute.
            for s, src, dst in blocks:
                sender.send_blocks(s.peer, s.transfer_id, layer, src, dst)

        return send_layer

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.states.pop(rid, None)
            self.pooler.drop(rid)
            if self.images is not None:
                self.images.drop(rid)
        for rid in sched.finished_req_ids:
            self.drafts.pop(rid, None)  # a preempted request keeps its drafts: it verifies them on resuming
        if self.proposer is not None:
            self.proposer.on_schedule(sched)
        for new in sched.new_reqs:
            params, outputs = new.sampling_params, list(new.token_ids[new.num_prompt_tokens :])
            # A resumed request (migrated) replays its earlier output too: the last prompt tokens.
            replay = list(new.token_ids[new.num_prompt_tokens - params.num_resumed_tokens :])
            self.states[new.req_id] = RequestState(
                list(new.token_ids), new.num_prompt_tokens, params, list(new.block_ids),
                matcher=self._new_matcher(new.req_id, params, replay),
                prompt_logprobs=[] if params.prompt_logprobs is not None and not outputs else None,
                lora_name=new.lora_name, images=new.images, plain=Sampler.plain_params(params),
            )
        for cached in sched.cached_reqs:
            self.states[cached.req_id].block_ids.extend(cached.new_block_ids)

    def _argmax_only(self, rid: str) -> bool:
        """Sampler.argmax_only of the request's next row, without making it."""
        st = self.states[rid]
        if not st.plain:
            return False
        split = st.num_prompt_tokens - st.params.num_resumed_tokens
        return len(st.token_ids) - split >= st.params.min_tokens or not self._suppressible(st.params)

    def _suppressible(self, params: SamplingParams) -> tuple[int, ...]:
        """What a row of the request suppresses while its output is shorter than min_tokens: eos and stop ids."""
        eos = () if params.ignore_eos or self.info.eos_token_id is None else (self.info.eos_token_id,)
        return eos + params.stop_token_ids

    def _sampling_rows(self, rid: str, drafts: tuple[int, ...] = ()) -> list[SamplingRow]:
        """The row at the request's next position, then one after each draft (which counts as output)."""
        st = self.states[rid]
        params = st.params
        # A resumed request's last prompt tokens are its earlier output: penalties and min_tokens see them so.
        split = st.num_prompt_tokens - params.num_resumed_tokens
        prompt = TokenSpan(st.token_ids, 0, split)
        outputs = TokenSpan(st.token_ids, split, len(st.token_ids))
        rows = []
        for j in range(len(drafts) + 1):
            out = outputs if j == 0 else [*outputs, *drafts[:j]]
            suppress = self._suppressible(params) if len(out) < params.min_tokens else ()
            rows.append(SamplingRow(params=params, prompt_token_ids=prompt, output_token_ids=out,
                                    position=len(st.token_ids) + j, suppress_token_ids=suppress))
        return rows

    def _prepare(self, sched: SchedulerOutput) -> StepBatch:
        """The step's flat batch (kvrelay.engine.step_batch), with its LoRA slots and image features."""
        batch = build_batch(sched, self.states, self.block_size, self.device)
        q_lens = batch.meta.query_lens_cpu
        lora = None if self.lora is None else self.lora.batch([self.states[r].lora_name for r in batch.req_ids], q_lens)
        embeds_at = None
        if self.images is not None:
            embeds_at = self.images.rows([(r, self.states[r].images, batch.offsets[i], batch.starts[i], q_lens[i])
                                          for i, r in enumerate(batch.req_ids) if self.states[r].images])
        return batch if lora is None and embeds_at is None else replace(batch, lora=lora, embeds_at=embeds_at)


def _token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Row r: the logprob and rank of targets[r] under logits[r], and the top k (raw logits, no processing)."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = torch.tensor(targets, dtype=torch.long, device=lp.device)[:, None]
    chosen_lp = lp.gather(1, chosen)
    rank = (lp > chosen_lp).sum(dim=-1, keepdim=True) + 1
    cols = [chosen.double(), chosen_lp.double(), rank.double()]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
        cols += [top_ids.double(), top_lp.double()]
    packed = torch.cat(cols, dim=1).cpu().tolist()
    return [TokenLogprobs(int(v[0]), v[1], int(v[2]), tuple((int(t), p) for t, p in zip(v[3 : 3 + k], v[3 + k :])))
            for v in packed]
