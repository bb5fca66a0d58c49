"""A scheduler driven without a model. A fake runner mirrors what the model runner keeps (block tables from
the scheduler output) and what the KV cache would hold (per slot, a key for the token prefix written there),
so that every step also checks that each request only attends to KV computed for its own tokens.

Speculative decoding (spec_lookahead, propose_fn, token_at): the fake target gives token_at(req, i) as output
i; scheduled drafts are written into the KV model with their own prefix keys and verified against it (kept
while equal). Beam search (beam_fn): a beam's row returns beam_fn(req) as its top (token, logprob) candidates;
block copies the scheduler orders are applied to the KV model before the step's writes."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable

from kvrelay.common.records import TokenLogprobs
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.config import SchedulerConfig, SchedulingPolicy
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvrelay.engine.spec_decode.scheduling import Speculation

EOS = 2
FCFS = SchedulingPolicy.FCFS
PRIORITY = SchedulingPolicy.PRIORITY
SJF = SchedulingPolicy.SJF


def default_token(req: Request) -> int:
    return 1000 + req.num_output_tokens


class Driver:
    """Scheduler + fake runner. `step()` = schedule -> execute -> update."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 16,
        budget: int = 2048,
        max_num_seqs: int = 128,
        policy: SchedulingPolicy = FCFS,
        caching: bool = True,
        max_model_len: int | None = None,
        chunked: bool = True,
        long_prefill: int = 0,
        token_fn: Callable[[Request], int] = default_token,
        spec_lookahead: int | None = None,
        propose_fn: Callable[[Request, tuple[int, ...]], list[int]] | None = None,
        token_at: Callable[[Request, int], int] | None = None,
        beam_fn: Callable[[Request], list[tuple[int, float]]] | None = None,
        headroom: bool = True,
        sjf_tokens_per_s: float = 1000.0,
        priority_step_gap: int = SchedulerConfig.priority_step_gap,
    ) -> None:
        self.bs = block_size
        self.pool = BlockPool(num_blocks, caching)
        self.kv = KVCacheManager(self.pool, block_size, "test-model", caching)
        self.config = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            policy=policy,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=long_prefill,
            admission_headroom=headroom,
            sjf_tokens_per_s=sjf_tokens_per_s,
            priority_step_gap=priority_step_gap,
        )
        self.max_model_len = max_model_len or num_blocks * block_size
        speculation = None if spec_lookahead is None else Speculation(
            lookahead=spec_lookahead, max_model_len=self.max_model_len, max_num_batched_tokens=budget)
        self.sched = Scheduler(self.config, self.kv, self.max_model_len, speculation)
        self.spec_lookahead = spec_lookahead
        self.propose_fn, self.beam_fn = propose_fn, beam_fn
        self.token_at = token_at or (lambda req, i: token_fn(req))
        self.token_fn = token_fn
        self.arrival = itertools.count()
        self.reqs: dict[str, Request] = {}  # every request ever added (the scheduler drops finished ones)
        self.tables: dict[str, list[int]] = {}  # the runner's block tables
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> prefix key of the KV written there
        self.keys: dict[int, tuple[Request, list[int]]] = {}  # id(request) -> (request, key per position)
        self.hash_keys: dict[bytes, list[int]] = {}  # block hash -> prefix keys of its positions
        self.outputs: dict[str, list[int]] = defaultdict(list)  # tokens streamed per request
        self.finish: dict[str, tuple[str, int | None]] = {}
        self.beam_results: dict[str, tuple] = {}  # beam search: group id -> its finished beams
        self.num_steps = 0

    # -- requests ---------------------------------------------------------------------------------------

    def add(
        self, rid: str, prompt: list[int], max_tokens: int | None = 16, priority: int = 0, salt: str = "",
        arrival: float | None = None, **params
    ) -> Request:
        """`arrival`: seconds (default: one more than the previous request's)."""
        sp = SamplingParams(max_tokens=max_tokens, priority=priority, **params)
        arrival = float(next(self.arrival)) if arrival is None else arrival
        req = Request(rid, prompt, sp, eos_token_id=EOS, arrival_time=arrival, cache_salt=salt)
        room = self.max_model_len - len(prompt)
        req.max_tokens = room if max_tokens is None else min(max_tokens, room)  # as EngineCore does
        self.sched.add_request(req)
        self.reqs[rid] = req
        self.outputs[rid] = []
        self.finish.pop(rid, None)
        return req

    def abort(self, *rids: str) -> list[str]:
        done = self.sched.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        return [r.request_id for r in done]

    # -- the step -------------------------------------------------------------------------------------

    def step(self) -> tuple[SchedulerOutput, dict[str, int]]:
        """The step's output and each sampling request's last new token (all of them: `last_sampled`)."""
        out = self.sched.schedule()
        self.num_steps += 1
        self._check_output(out)
        self._runner_update(out)
        self._copy_blocks(out.block_copies)
        self._execute(out)
        sampled, logprobs, drafts = {}, {}, {}
        for rid in out.num_scheduled_tokens:
            req = self.sched.requests[rid]
            spec = out.scheduled_spec_tokens.get(rid, ())
            if req.num_computed_tokens != req.num_tokens + len(spec):
                continue
            if req.beam_group is not None:
                top = self.beam_fn(req)
                sampled[rid] = (top[0][0],)
                logprobs[rid] = (TokenLogprobs(top[0][0], top[0][1], 1, tuple(top)),)
                continue
            sampled[rid] = self._verify(req, spec)
            if rid in out.propose_req_ids and self.propose_fn is not None:
                drafts[rid] = tuple(self.propose_fn(req, sampled[rid]))
        result = ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, spec_token_ids=drafts)
        for eo in self.sched.update_from_output(out, result):
            if eo.beams:
                self.beam_results[eo.req_id] = eo.beams
                self.finish[eo.req_id] = (eo.finish_reason, eo.stop_reason)
                continue
            got = sampled[eo.req_id]
            # A stop condition may cut an accepted run short, and only then.
            assert eo.new_token_ids == got or (eo.finish_reason and got[: len(eo.new_token_ids)] == eo.new_token_ids)
            self.outputs[eo.req_id].extend(eo.new_token_ids)
            if eo.finish_reason is not None:
                self.finish[eo.req_id] = (eo.finish_reason, eo.stop_reason)
        self.last_sampled = sampled
        self.check_cached_blocks()  # blocks verification filled with accepted tokens are hashed at update
        return out, {rid: tokens[-1] for rid, tokens in sampled.items()}

    def _verify(self, req: Request, drafts: tuple[int, ...]) -> tuple[int, ...]:
        """The fake target's tokens at the drafts' positions, kept while the drafts agree, then one more."""
        tokens = []
        for j, draft in enumerate(drafts):
            tokens.append(self.token_at(req, req.num_output_tokens + j))
            if tokens[-1] != draft:
                return tuple(tokens)
        tokens.append(self.token_at(req, req.num_output_tokens + len(drafts)))
        return tuple(tokens)

    def _copy_blocks(self, copies) -> None:
        for src, dst in copies:
            for o in range(self.bs):
                if (src, o) in self.slots:
                    self.slots[(dst, o)] = self.slots[(src, o)]
                else:
                    self.slots.pop((dst, o), None)

    def run(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished():
            assert len(outs) < max_steps, "requests did not finish"
            outs.append(self.step()[0])
        return outs

    def _check_output(self, out: SchedulerOutput) -> None:
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        assert len(self.sched.running) <= self.config.max_num_seqs
        listed = [d.req_id for d in out.new_reqs] + [d.req_id for d in out.cached_reqs]
        assert sorted(listed) == sorted(out.num_scheduled_tokens)
        assert not (out.preempted_req_ids & set(out.num_scheduled_tokens))
        for d in out.new_reqs:
            req = self.sched.requests[d.req_id]
            assert d.num_computed_tokens + out.num_scheduled_tokens[d.req_id] == req.num_computed_tokens
            assert d.token_ids == tuple(req.all_token_ids) and d.num_prompt_tokens == req.num_prompt_tokens
        for d in out.cached_reqs:
            req = self.sched.requests[d.req_id]
            assert d.num_computed_tokens + out.num_scheduled_tokens[d.req_id] == req.num_computed_tokens
        for rid, spec in out.scheduled_spec_tokens.items():
            req = self.sched.requests[rid]
            assert spec and spec == tuple(req.spec_token_ids[: len(spec)])
            assert req.num_computed_tokens == req.num_tokens + len(spec), "drafts only after the last known token"
            assert req.num_tokens + len(spec) < self.max_model_len
            assert req.max_tokens is None or req.num_output_tokens + len(spec) < req.max_tokens

    def _runner_update(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
        for d in out.new_reqs:  # a new request, or one whose table changed other than by appending
            self.tables[d.req_id] = list(d.block_ids)
        for d in out.cached_reqs:
            self.tables[d.req_id].extend(d.new_block_ids)
        for rid in out.num_scheduled_tokens:
            assert self.tables[rid] == self.kv.block_ids(rid)

    def prefix_keys(self, req: Request) -> list[int]:
        keys = self.keys.setdefault(id(req), (req, []))[1]
        for p in range(len(keys), req.num_tokens):
            keys.append(hash((keys[-1] if keys else req.cache_salt, req.all_token_ids[p])))
        return keys

    def draft_keys(self, req: Request, drafts: tuple[int, ...]) -> list[int]:
        """Prefix keys of the known tokens, then of the drafts after them."""
        keys = list(self.prefix_keys(req))
        for t in drafts:
            keys.append(hash((keys[-1], t)))
        return keys

    def _execute(self, out: SchedulerOutput) -> None:
        bs = self.bs
        writes: dict[tuple[int, int], int] = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            spec = out.scheduled_spec_tokens.get(rid, ())
            end = req.num_computed_tokens
            assert end <= req.num_tokens + len(spec)
            table = self.tables[rid]
            need = -(-end // bs)
            if self.spec_lookahead:
                assert need <= len(table) <= -(-(end + self.spec_lookahead) // bs), "table past its lookahead"
            else:
                assert len(table) == need, "block table must cover exactly the computed tokens"
            keys = self.draft_keys(req, spec)
            for p in range(end - n, end):
                slot = (table[p // bs], p % bs)
                assert writes.setdefault(slot, keys[p]) == keys[p], "two requests write one slot"
        self.slots.update(writes)
        # Attention reads every position up to the last computed one (the step's writes included).
        for rid in out.num_scheduled_tokens:
            req = self.sched.requests[rid]
            table = self.tables[rid]
            keys = self.draft_keys(req, out.scheduled_spec_tokens.get(rid, ()))
            for p in range(req.num_computed_tokens):
                assert self.slots.get((table[p // bs], p % bs)) == keys[p], f"{rid} reads wrong KV at {p}"
        self.check_cached_blocks()

    def check_cached_blocks(self) -> None:
        """Every block in the hash map holds the KV of exactly the tokens its hash names."""
        for req in self.sched.requests.values():
            keys = self.prefix_keys(req)
            for i, hsh in enumerate(req.block_hashes):
                self.hash_keys.setdefault(hsh, keys[i * self.bs : (i + 1) * self.bs])
        for hsh, blk in self.pool.cached.items():
            assert blk.block_hash == hsh
            want = self.hash_keys[hsh]
            got = [self.slots.get((blk.block_id, o)) for o in range(self.bs)]
            assert got == want, f"cached block {blk.block_id} does not hold what its hash names"

    # -- checks ---------------------------------------------------------------------------------------

    def check_blocks(self) -> None:
        pool, kv = self.pool, self.kv
        free = pool.free_queue.block_ids()
        assert len(free) == len(set(free)) == pool.num_free_blocks
        refs = defaultdict(int)
        for rid, blocks in kv.req_to_blocks.items():
            assert rid in self.sched.requests
            for b in blocks:
                refs[b.block_id] += 1
        for b in pool.blocks:
            assert b.ref_cnt == refs[b.block_id]
            assert (b.ref_cnt == 0) == (b.block_id in free)
        for req in self.sched.requests.values():
            if req.status == RequestStatus.RUNNING:
                assert req in self.sched.running
                have, need = len(kv.block_ids(req.request_id)), -(-req.num_computed_tokens // self.bs)
                if self.spec_lookahead:  # the proposer's lookahead slots, and no more
                    assert need <= have <= -(-(req.num_computed_tokens + self.spec_lookahead) // self.bs)
                else:
                    assert have == need
            else:
                assert req not in self.sched.running and not kv.holds(req.request_id)
                assert req.num_computed_tokens == 0

    def check_all_free(self) -> None:
        assert not self.sched.has_unfinished() and not self.sched.requests and not self.kv.req_to_blocks
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        self.check_cached_blocks()


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


# -- budget and chunked prefill ---------------------------------------------------------------------


def tokens_then(seq: list[int]) -> Callable[[Request], int]:
    """Sample seq[i] as the i-th output token (then 1000+i)."""
    return lambda req: seq[req.num_output_tokens] if req.num_output_tokens < len(seq) else 1000 + req.num_output_tokens
