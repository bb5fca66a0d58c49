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
Block copies the scheduler orders (copy-on-write of a beam's shared block) run before the forward pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from shared.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from shared.engine.attention import get_attention_backend
from shared.engine.attention.base import AttentionMetadata
from shared.engine.model_info import ModelInfo
from shared.engine.models.loader import load_model
from shared.engine.sampler import Sampler, SamplingRow
from shared.engine.scheduler_output import KVSend, ModelRunnerOutput, SchedulerOutput
from shared.engine.spec_decode import Draft, ProposeRequest, Verifier, VerifyGroup, create_proposer
from shared.records import KVLayout, kv_cache_shape
from shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_CUDA_ACTIVATION_RESERVE = 2 * 1024**3


class KVSender(Protocol):
    """Where a prefill node's KV goes (a kv_transfer connector): the engine registers its caches once, and
    the runner enqueues each layer's blocks as soon as the layer is written."""

    def register_kv_caches(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None: ...

    def send_blocks(self, peer: str, transfer_id: str, layer: int, src: list[int], dst: list[int]) -> None: ...


@dataclass
class _ReqState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]


@dataclass(frozen=True)
class _Batch:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_req_ids: list[str]
    logits_indices: torch.Tensor  # per sampling request: its last known token's row, then its drafts' rows


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, kv_sender: KVSender | None = None) -> None:
        self.config = config
        self.info = info
        self.device = info.device
        self.dtype = info.dtype
        self.block_size = config.cache.block_size
        self.attn = get_attention_backend(config.model.attention_backend, self.device)
        self.model = load_model(info.path, self.dtype, self.device, self.attn)
        self.vocab_size = self.model.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device, seed=config.model.seed)
        self.verifier = Verifier(self.sampler, config.model.seed, self.device)
        self.proposer = (create_proposer(config, self.vocab_size, self.dtype, self.device)
                         if config.speculative is not None else None)
        self.drafts: dict[str, Draft] = {}  # proposed last step, verified when scheduled
        self.kv_caches: list[torch.Tensor] = []
        self.states: dict[str, _ReqState] = {}
        self.kv_sender = kv_sender

    # -- KV cache ----------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.dtype).element_size()
        draft = self.proposer.kv_bytes_per_block if self.proposer is not None else 0
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_size * elem + draft

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
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
        shape = kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads, m.head_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(m.num_layers)]
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        draft = self.proposer.kv_caches if self.proposer is not None else []
        for cache in [*self.kv_caches, *draft]:
            cache.index_copy_(1, dst, cache.index_select(1, src))

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
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, on_layer_done)
        if not batch.sample_req_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        specs = sched.scheduled_spec_tokens
        rows, groups = [], []
        for rid in batch.sample_req_ids:
            drafts = specs.get(rid, ())
            groups.append(VerifyGroup(rid, len(rows), drafts, self._draft_probs(rid, drafts)))
            rows.extend(self._sampling_rows(rid, drafts))
        sampled, logprobs = {}, {}
        for rid, v in self.verifier(logits, rows, groups).items():
            self.states[rid].token_ids.extend(v.token_ids)
            sampled[rid] = v.token_ids
            if v.logprobs:
                logprobs[rid] = v.logprobs
        drafts = self._propose(sched, sampled)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, spec_token_ids=drafts)

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

    def _layer_sender(self, sends: tuple[KVSend, ...]):
        if self.kv_sender is None:
            raise RuntimeError("kv_sends scheduled but the engine was built without a KV sender")
        sender = self.kv_sender

        def send_layer(layer: int) -> None:
            # send_blocks only enqueues: the connector's thread moves the bytes while later layers compute.
            for s in sends:
                sender.send_blocks(s.peer, s.transfer_id, layer, list(s.src_block_ids), list(s.dst_block_ids))

        return send_layer

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.states.pop(rid, None)
        for rid in sched.finished_req_ids:
            self.drafts.pop(rid, None)  # a preempted request keeps its drafts: it verifies them on resuming
        if self.proposer is not None:
            self.proposer.on_schedule(sched)
        for new in sched.new_reqs:
            self.states[new.req_id] = _ReqState(
                list(new.token_ids), new.num_prompt_tokens, new.sampling_params, list(new.block_ids)
            )
        for cached in sched.cached_reqs:
            self.states[cached.req_id].block_ids.extend(cached.new_block_ids)

    def _sampling_rows(self, rid: str, drafts: tuple[int, ...] = ()) -> list[SamplingRow]:
        """The row at the request's next position, then one after each draft (which counts as output)."""
        st = self.states[rid]
        params = st.params
        prompt = st.token_ids[: st.num_prompt_tokens]
        outputs = st.token_ids[st.num_prompt_tokens :]
        eos = () if params.ignore_eos or self.info.eos_token_id is None else (self.info.eos_token_id,)
        rows = []
        for j in range(len(drafts) + 1):
            out = outputs if j == 0 else [*outputs, *drafts[:j]]
            suppress = eos + params.stop_token_ids if len(out) < params.min_tokens else ()
            rows.append(SamplingRow(params=params, prompt_token_ids=prompt, output_token_ids=out,
                                    position=len(st.token_ids) + j, suppress_token_ids=suppress))
        return rows

    def _prepare(self, sched: SchedulerOutput) -> _Batch:
        counts, specs = sched.num_scheduled_tokens, sched.scheduled_spec_tokens
        computed = {c.req_id: c.num_computed_tokens for c in sched.cached_reqs}
        computed.update({n.req_id: n.num_computed_tokens for n in sched.new_reqs})
        # Attention rows: (request, first position, query length). A decode that carries drafts becomes one
        # single-token row per token, so each of its logits is computed exactly as a plain decode's would be.
        attn_rows = []
        for rid, count in counts.items():
            num_drafts = len(specs.get(rid, ()))
            if num_drafts and count == num_drafts + 1:
                attn_rows.extend((rid, computed[rid] + j, 1) for j in range(count))
            else:
                attn_rows.append((rid, computed[rid], count))
        # Decodes first: backends batch the single-token rows together (stable: a request's rows stay in order).
        attn_rows.sort(key=lambda r: r[2] != 1)
        req_ids = [r[0] for r in attn_rows]
        num_decodes = sum(1 for r in attn_rows if r[2] == 1)
        bs = self.block_size
        q_lens = [r[2] for r in attn_rows]
        starts = [r[1] for r in attn_rows]
        seq_lens = [s + q for s, q in zip(starts, q_lens)]
        ids_parts, pos_parts, slot_parts = [], [], []
        max_blocks = max(len(self.states[r].block_ids) for r in req_ids)
        tables = np.zeros((len(req_ids), max_blocks), dtype=np.int32)
        sample_ids, sample_rows = [], []
        offset = 0
        for i, rid in enumerate(req_ids):
            st = self.states[rid]
            drafts = specs.get(rid, ())
            table = np.asarray(st.block_ids, dtype=np.int64)
            tables[i, : len(table)] = table
            pos = np.arange(starts[i], seq_lens[i], dtype=np.int64)
            ids_parts.append(_tokens(st.token_ids, drafts, starts[i], seq_lens[i]))
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            offset += q_lens[i]
            if seq_lens[i] == len(st.token_ids) + len(drafts):  # reaches the end: it samples (and verifies)
                sample_ids.append(rid)
                sample_rows.extend(range(offset - len(drafts) - 1, offset))
        dev = self.device
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        meta = AttentionMetadata(
            num_reqs=len(req_ids),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            block_size=bs,
        )
        input_ids = torch.tensor([t for part in ids_parts for t in part], dtype=torch.int64, device=dev)
        return _Batch(
            req_ids=list(counts),
            input_ids=input_ids,
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            sample_req_ids=sample_ids,
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )


def _tokens(known: list[int], drafts: tuple[int, ...], start: int, end: int) -> list[int]:
    """Positions [start, end) of the known tokens followed by the drafts."""
    n = len(known)
    if end <= n:
        return known[start:end]
    return [*known[start:n], *drafts[max(0, start - n) : end - n]]
