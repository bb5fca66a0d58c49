"""Model runner: turns a SchedulerOutput into one flat forward pass and samples. No policy lives here.

Per-request state lifecycle:
1. A NewRequestData creates (or, after preemption, recreates) the request's state: tokens, block ids.
2. Each CachedRequestData appends the step's new block ids.
3. After the forward, rows whose computed tokens reach the end of their known tokens sample one token,
   which is appended to the state.
4. Finished and preempted ids drop the state.
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
    logits_indices: torch.Tensor


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
        self.kv_caches: list[torch.Tensor] = []
        self.states: dict[str, _ReqState] = {}
        self.kv_sender = kv_sender

    # -- KV cache ----------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.dtype).element_size()
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_size * elem

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

    # -- step ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        batch = self._prepare(sched)
        on_layer_done = self._layer_sender(sched.kv_sends) if sched.kv_sends else None
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, on_layer_done)
        if not batch.sample_req_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows = [self._sampling_row(rid) for rid in batch.sample_req_ids]
        out = self.sampler(logits, rows)
        sampled, logprobs = {}, {}
        for rid, token, lp in zip(batch.sample_req_ids, out.token_ids, out.logprobs):
            self.states[rid].token_ids.append(token)
            sampled[rid] = token
            if lp is not None:
                logprobs[rid] = lp
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

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
        for new in sched.new_reqs:
            self.states[new.req_id] = _ReqState(
                list(new.token_ids), new.num_prompt_tokens, new.sampling_params, list(new.block_ids)
            )
        for cached in sched.cached_reqs:
            self.states[cached.req_id].block_ids.extend(cached.new_block_ids)

    def _sampling_row(self, rid: str) -> SamplingRow:
        st = self.states[rid]
        params = st.params
        # A resumed request's last prompt tokens are its earlier output: penalties and min_tokens see them so.
        split = st.num_prompt_tokens - params.num_resumed_tokens
        outputs = st.token_ids[split:]
        suppress: tuple[int, ...] = ()
        if len(outputs) < params.min_tokens:
            eos = () if params.ignore_eos or self.info.eos_token_id is None else (self.info.eos_token_id,)
            suppress = eos + params.stop_token_ids
        return SamplingRow(
            params=params,
            prompt_token_ids=st.token_ids[:split],
            output_token_ids=outputs,
            position=len(st.token_ids),
            suppress_token_ids=suppress,
        )

    def _prepare(self, sched: SchedulerOutput) -> _Batch:
        counts = sched.num_scheduled_tokens
        computed = {c.req_id: c.num_computed_tokens for c in sched.cached_reqs}
        computed.update({n.req_id: n.num_computed_tokens for n in sched.new_reqs})
        # Decodes first: backends batch the single-token rows together.
        req_ids = sorted(counts, key=lambda r: counts[r] != 1)
        num_decodes = sum(1 for r in req_ids if counts[r] == 1)
        bs = self.block_size
        q_lens = [counts[r] for r in req_ids]
        starts = [computed[r] for r in req_ids]
        seq_lens = [s + q for s, q in zip(starts, q_lens)]
        ids_parts, pos_parts, slot_parts = [], [], []
        max_blocks = max(len(self.states[r].block_ids) for r in req_ids)
        tables = np.zeros((len(req_ids), max_blocks), dtype=np.int32)
        sample_ids, sample_rows = [], []
        offset = 0
        for i, rid in enumerate(req_ids):
            st = self.states[rid]
            table = np.asarray(st.block_ids, dtype=np.int64)
            tables[i, : len(table)] = table
            pos = np.arange(starts[i], seq_lens[i], dtype=np.int64)
            ids_parts.append(st.token_ids[starts[i] : seq_lens[i]])
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            offset += q_lens[i]
            if seq_lens[i] == len(st.token_ids):
                sample_ids.append(rid)
                sample_rows.append(offset - 1)
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
            req_ids=req_ids,
            input_ids=input_ids,
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            sample_req_ids=sample_ids,
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )
