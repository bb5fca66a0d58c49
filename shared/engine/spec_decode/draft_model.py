"""Draft-model proposals: a smaller model with the target's vocabulary drafts autoregressively.

The draft keeps its own paged KV cache, indexed by the target's block ids: a block holds the target's KV of
its tokens in the target's cache and the draft's in this one, so the scheduler's block tables serve both.

Draft KV lifecycle (per request, and per block):
1. A request's draft KV is caught up lazily, when it next proposes: one forward feeds every known token
   past what the draft holds (a whole prompt the first time), then k - 1 single-token rounds draft
   autoregressively, writing their KV into the lookahead slots the scheduler allocated.
2. After verification only positions before the newest token still hold the right tokens' KV: drafts
   that were rejected, and anything past them, are recomputed next time.
3. A full block whose draft KV was computed from known tokens is marked; a request that hits it in the
   prefix cache starts from it. A block the scheduler hands out anew (or fills from a KV transfer) is
   unmarked, so the draft never reads KV it did not write for those tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.common.records import kv_cache_shape
from kvrelay.engine import host_memory
from kvrelay.engine.attention import get_attention_backend
from kvrelay.engine.attention.base import AttentionMetadata
from kvrelay.engine.config import EngineConfig, ModelConfig, dtype_name
from kvrelay.engine.model_info import load_model_info
from kvrelay.engine.models.loader import load_model
from kvrelay.engine.sampler import Sampler, SamplingRow
from kvrelay.engine.scheduler_output import SchedulerOutput
from kvrelay.engine.spec_decode.base import Draft, Proposer, ProposeRequest
from kvrelay.engine.spec_decode.sampling import DRAFT_STREAM, KeyedDraws, probs, race


@dataclass
class _DraftState:
    block_ids: list[int]
    valid: int  # leading positions whose draft KV was computed from this request's current tokens
    marked: int = 0  # leading blocks already marked full


@dataclass(frozen=True)
class _Segment:
    req_id: str
    token_ids: list[int]
    start: int  # position of the first token
    block_ids: Sequence[int]


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, target_vocab_size: int, target_dtype: torch.dtype,
                 device: torch.device) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        self.k = spec.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.device = device
        info = load_model_info(ModelConfig(model=spec.model, dtype=spec.dtype or dtype_name(target_dtype),
                                           device=str(device)))
        self.dtype = info.dtype
        self.model = load_model(info.path, info.dtype, device, get_attention_backend(
            config.model.attention_backend, device), quantization=info.quantization)  # a quantized draft too
        if self.model.vocab_size < target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({self.model.vocab_size} tokens) "
                             f"does not cover the target's ({target_vocab_size}); it must share its tokenizer")
        self.vocab_size = target_vocab_size
        self.max_positions = self.model.max_position_embeddings
        m = self.model
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_block = m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_size * elem
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler(target_vocab_size, device, seed=config.model.seed)
        self.draws = KeyedDraws(DRAFT_STREAM, config.model.seed, device)
        self.states: dict[str, _DraftState] = {}
        self.full: set[int] = set()  # blocks whose draft KV is complete for their (hashed) tokens

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads, m.head_size)
        self.kv_caches = [host_memory.zeros(shape, self.dtype, self.device) for _ in range(m.num_layers)]

    # -- following the scheduler -------------------------------------------------------------------------

    def on_schedule(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.states.pop(rid, None)
        bs = self.block_size
        for new in sched.new_reqs:
            blocks = list(new.block_ids)
            old = self.states.get(new.req_id)
            if old is None:  # admitted: its prefix-cache hits may carry draft KV, nothing else does
                own = (new.num_computed_tokens - new.num_external_tokens) // bs
                hits = next((i for i, b in enumerate(blocks[:own]) if b not in self.full), own)
                fresh, valid = hits, hits * bs
            else:  # its table was rebuilt (blocks given back after a verification): the common prefix holds
                fresh = next((i for i, (a, b) in enumerate(zip(old.block_ids, blocks)) if a != b),
                             min(len(old.block_ids), len(blocks)))
                valid = min(old.valid, fresh * bs)
            self.full.difference_update(blocks[fresh:])
            self.states[new.req_id] = _DraftState(blocks, valid, min(fresh, old.marked if old else fresh))
        for cached in sched.cached_reqs:
            st = self.states.get(cached.req_id)
            if st is not None:
                st.block_ids.extend(cached.new_block_ids)
            self.full.difference_update(cached.new_block_ids)

    # -- proposing ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposeRequest]) -> dict[str, Draft]:
        active, segments, budgets = [], [], {}
        for r in requests:
            st = self.states.get(r.req_id)
            if st is None:
                continue
            n = len(r.token_ids)
            st.valid = min(st.valid, n - 1)  # the newest token replaced whatever draft sat at its position
            # Round j (1-based) writes position n + j - 2: within the table and the draft's positions.
            k = min(self.k, len(st.block_ids) * self.block_size - n + 1, self.max_positions - n + 1)
            if k < 1:
                continue
            active.append(r)
            budgets[r.req_id] = k
            segments.append(_Segment(r.req_id, list(r.token_ids[st.valid :]), st.valid, st.block_ids))
        if not active:
            return {}
        drafts: dict[str, list[int]] = {r.req_id: [] for r in active}
        dists: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in active}
        by_id = {r.req_id: r for r in active}
        for j in range(1, self.k + 1):
            if j > 1:
                segments = [_Segment(rid, [drafts[rid][-1]], len(by_id[rid].token_ids) + j - 2,
                                     self.states[rid].block_ids)
                            for rid in drafts if budgets[rid] >= j]
                if not segments:
                    break
            logits = self._forward(segments)
            for seg, row in zip(segments, logits):
                r = by_id[seg.req_id]
                token, dist = self._sample(r, drafts[seg.req_id], row)
                drafts[seg.req_id].append(token)
                if dist is not None:
                    dists[seg.req_id].append(dist)
            if j == 1:
                for r in active:
                    self._mark_full(self.states[r.req_id], len(r.token_ids))
        for rid, tokens in drafts.items():
            self.states[rid].valid = len(by_id[rid].token_ids) + len(tokens) - 1
        return {rid: Draft(tuple(tokens), torch.stack(dists[rid]) if dists[rid] else None)
                for rid, tokens in drafts.items()}

    def _sample(self, r: ProposeRequest, drafted: list[int], logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        outputs = [*r.token_ids[r.num_prompt_tokens :], *drafted]
        row = SamplingRow(r.params, r.token_ids[: r.num_prompt_tokens], outputs, len(r.token_ids) + len(drafted))
        if r.params.greedy:
            return int(self.sampler.processed_logits(logits[None, : self.vocab_size].float(), [row]).argmax()), None
        q = probs(self.sampler, logits[None], [row])[0]
        return race(q, self.draws.uniform(row, q.numel())), q

    def _mark_full(self, st: _DraftState, num_known: int) -> None:
        """Blocks below the newest token now hold draft KV of final tokens."""
        end = min(num_known // self.block_size, len(st.block_ids))
        if end > st.marked:
            self.full.update(st.block_ids[st.marked : end])
            st.marked = end

    def _forward(self, segments: list[_Segment]) -> torch.Tensor:
        """Run the draft over the segments (decodes first, as backends want); logits of each one's last token,
        in the order given."""
        order = sorted(range(len(segments)), key=lambda i: len(segments[i].token_ids) != 1)
        segs = [segments[i] for i in order]
        bs, dev = self.block_size, self.device
        q_lens = [len(s.token_ids) for s in segs]
        seq_lens = [s.start + q for s, q in zip(segs, q_lens)]
        tables = np.zeros((len(segs), max(len(s.block_ids) for s in segs)), dtype=np.int32)
        pos_parts, slot_parts = [], []
        for i, s in enumerate(segs):
            table = np.asarray(s.block_ids, dtype=np.int64)
            tables[i, : len(table)] = table
            pos = np.arange(s.start, seq_lens[i], dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
        qsl = np.zeros(len(segs) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        num_decodes = sum(1 for q in q_lens if q == 1)
        meta = AttentionMetadata(
            num_reqs=len(segs), num_decodes=num_decodes, num_decode_tokens=num_decodes,
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev), block_size=bs,
        )
        ids = torch.tensor([t for s in segs for t in s.token_ids], dtype=torch.int64, device=dev)
        positions = torch.from_numpy(np.concatenate(pos_parts)).to(dev)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        last = torch.from_numpy(qsl[1:].astype(np.int64) - 1).to(dev)
        logits = self.model.compute_logits(hidden[last])
        back = [0] * len(order)
        for pos_in_sorted, original in enumerate(order):
            back[original] = pos_in_sorted
        return logits[torch.tensor(back, device=dev)]
