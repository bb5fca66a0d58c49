"""One step's flat batch, built from a SchedulerOutput and the model runner's per-request state: token ids,
positions, the attention metadata (slots, block tables, lengths) and which rows sample or pool.

Attention rows are (request, first position, query length). A decode that carries drafts becomes one single-token
row per token, so each of its logits is computed exactly as a plain decode's would be. Decodes come first (the
attention backends batch the single-token rows together); a request's rows stay in order.

Every token's position and slot is computed in a few numpy calls over the whole step, not several per request: at
256 decode rows the per-request calls cost ~1 ms a step, which a GPU step waits for.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.common.records import ImageInput, TokenLogprobs
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.attention.base import AttentionMetadata
from kvrelay.engine.lora.layers import LoRABatch
from kvrelay.engine.scheduler_output import SchedulerOutput
from kvrelay.engine.structured import GrammarMatcher


@dataclass
class RequestState:
    """What the model runner keeps of a request between steps."""

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    matcher: GrammarMatcher | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # computed so far (none while it has outputs)
    lora_name: str = ""  # its LoRA adapter ("": the base model)
    images: tuple[ImageInput, ...] = ()  # its prompt's images
    plain: bool = False  # Sampler.plain_params(params): its tokens are the argmax once min_tokens is reached


@dataclass(frozen=True)
class StepBatch:
    req_ids: list[str]  # per attention row
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_req_ids: list[str]
    logits_indices: torch.Tensor  # per sampling request: its last known token's row, then its drafts' rows
    pooling: list[int]  # attention rows (req_ids) of pooling requests
    pool_rows: dict[str, int]  # per pooling request whose prompt this step completes: its last row
    offsets: list[int]  # per attention row (req_ids): its first row in the flat batch
    starts: list[int]  # per attention row: its first position this step
    lora: LoRABatch | None = None  # each flat row's adapter slot (None: no row has an adapter)
    embeds_at: tuple[torch.Tensor, torch.Tensor] | None = None  # image features at their rows (ImageEncoder.rows)


def build_batch(sched: SchedulerOutput, states: Mapping[str, RequestState], block_size: int,
                device: torch.device) -> StepBatch:
    """The step's batch on `device` (no LoRA slots or image features: the runner adds those)."""
    counts, specs = sched.num_scheduled_tokens, sched.scheduled_spec_tokens
    computed = {c.req_id: c.num_computed_tokens for c in sched.cached_reqs}
    computed.update({n.req_id: n.num_computed_tokens for n in sched.new_reqs})
    attn_rows = []
    for rid, count in counts.items():
        num_drafts = len(specs.get(rid, ()))
        if num_drafts and count == num_drafts + 1:
            attn_rows.extend((rid, computed[rid] + j, 1) for j in range(count))
        else:
            attn_rows.append((rid, computed[rid], count))
    attn_rows.sort(key=lambda r: r[2] != 1)  # decodes first (stable)
    req_ids = [r[0] for r in attn_rows]
    num_decodes = sum(1 for r in attn_rows if r[2] == 1)
    q_lens = [r[2] for r in attn_rows]
    starts = [r[1] for r in attn_rows]
    seq_lens = [s + q for s, q in zip(starts, q_lens)]
    ids: list[int] = []
    block_lists = []
    sample_ids, sample_rows, offsets, pooling, pool_rows = [], [], [], [], {}
    offset = 0
    for i, rid in enumerate(req_ids):
        offsets.append(offset)
        st = states[rid]
        drafts = specs.get(rid, ())
        block_lists.append(st.block_ids)
        ids.extend(_tokens(st.token_ids, drafts, starts[i], seq_lens[i]))
        offset += q_lens[i]
        if st.params.pooling is not None:
            pooling.append(i)
            if seq_lens[i] == len(st.token_ids):  # its vector, no token
                pool_rows[rid] = offset - 1
        elif seq_lens[i] == len(st.token_ids) + len(drafts):  # reaches the end: it samples (and verifies)
            sample_ids.append(rid)
            sample_rows.extend(range(offset - len(drafts) - 1, offset))
    qsl = np.zeros(len(req_ids) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    bs = block_size
    tables = _block_tables(block_lists)
    row_of = np.repeat(np.arange(len(req_ids)), q_lens)
    positions = np.asarray(starts, dtype=np.int64)[row_of] + np.arange(offset) - qsl[:-1][row_of]
    slots = tables[row_of, positions // bs].astype(np.int64) * bs + positions % bs
    meta = AttentionMetadata(
        num_reqs=len(req_ids),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        block_size=bs,
    )
    return StepBatch(
        req_ids=req_ids,
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        sample_req_ids=sample_ids,
        logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=device),
        pooling=pooling,
        pool_rows=pool_rows,
        offsets=offsets,
        starts=starts,
    )


def _block_tables(block_lists: list[list[int]]) -> np.ndarray:
    """int32 [rows, longest]: each row's block ids, then zeros."""
    lens = np.fromiter(map(len, block_lists), dtype=np.int64, count=len(block_lists))
    tables = np.zeros((len(block_lists), max(int(lens.max()), 1)), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_lists), dtype=np.int32, count=int(lens.sum()))
    return tables


def _tokens(known: list[int], drafts: tuple[int, ...], start: int, end: int) -> list[int]:
    """Positions [start, end) of the known tokens followed by the drafts."""
    n = len(known)
    if end <= n:
        return known[start:end]
    return [*known[start:n], *drafts[max(0, start - n) : end - n]]
