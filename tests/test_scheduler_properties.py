"""Property tests of scheduler + KV cache manager + block pool: random arrivals with shared prefixes, random
aborts, small pools that force preemption, both policies, with and without prefix caching, random budgets.

The Driver (tests/test_scheduler.py) checks on every step: the budget, max_num_seqs, the scheduler output
against the runner's view of block tables, and a model of the KV contents (no request reads KV that was
not computed for its own token prefix; every block in the hash map holds what its hash names)."""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shared.config import SchedulingPolicy
from shared.request import Request
from tests.test_scheduler import EOS, Driver

BASES = [[(7 * i + 3 * k) % 23 + 3 for i in range(64)] for k in range(3)]  # shared-prefix sources
STOP_ID = 5
RIDS = [f"r{i}" for i in range(12)]  # a small id space: ids are reused after a request ends


def sampled_token(rid: str, index: int) -> int:
    """The token the fake model samples as output `index` of request `rid` (EOS and STOP_ID now and then)."""
    return zlib.crc32(f"{rid}/{index}".encode()) % 60


def token_fn(req: Request) -> int:
    return sampled_token(req.request_id, req.num_output_tokens)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(3, 20),
        budget=st.integers(1, 48),
        max_num_seqs=st.integers(1, 6),
        policy=st.sampled_from(list(SchedulingPolicy)),
        caching=st.booleans(),
        long_prefill=st.sampled_from([0, 0, 3, 8]),
    )
    def setup(self, block_size, num_blocks, budget, max_num_seqs, policy, caching, long_prefill):
        self.d = Driver(
            num_blocks=num_blocks,
            block_size=block_size,
            budget=budget,
            max_num_seqs=max_num_seqs,
            policy=policy,
            caching=caching,
            long_prefill=long_prefill,
            token_fn=token_fn,
        )
        self.max_prompt = min(self.d.max_model_len - 1, 40)

    @precondition(lambda self: len(self.d.sched.requests) < len(RIDS))
    @rule(data=st.data())
    def add_request(self, data):
        d = self.d
        rid = data.draw(st.sampled_from([r for r in RIDS if r not in d.sched.requests]), label="rid")
        base = data.draw(st.sampled_from(BASES), label="base")
        n_shared = data.draw(st.integers(0, self.max_prompt), label="shared")
        n_own = data.draw(st.integers(0 if n_shared else 1, self.max_prompt - n_shared), label="own")
        own = data.draw(st.lists(st.integers(0, 99), min_size=n_own, max_size=n_own), label="own_tokens")
        d.add(
            rid,
            base[:n_shared] + own,
            max_tokens=data.draw(st.integers(1, 12), label="max_tokens"),
            priority=data.draw(st.integers(0, 3), label="priority"),
            salt=data.draw(st.sampled_from(["", "", "t1"]), label="salt"),
            stop_token_ids=data.draw(st.sampled_from([(), (STOP_ID,)]), label="stop"),
            ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
            min_tokens=data.draw(st.integers(0, 1), label="min_tokens"),
        )

    @precondition(lambda self: len(self.d.sched.requests) > 0)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.d.sched.requests)), label="abort")
        assert self.d.abort(rid) == [rid]
        self.check_finished(rid)

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            self.d.step()
            self.check_blocks()
            for rid in self.d.finish:
                if rid not in self.d.sched.requests:
                    self.check_finished(rid)

    @invariant()
    def check_blocks(self):
        d = self.d
        d.check_blocks()
        assert len(d.sched.running) <= d.config.max_num_seqs
        assert sum(b.ref_cnt for b in d.pool.blocks) == sum(len(v) for v in d.kv.req_to_blocks.values())
        for hsh, blk in d.pool.cached.items():
            assert blk.block_hash == hsh

    def check_finished(self, rid: str) -> None:
        d, req = self.d, self.d.reqs[rid]
        out = d.outputs[rid]
        assert out == [sampled_token(rid, i) for i in range(len(out))], "tokens lost or repeated"
        assert out == req.output_token_ids
        assert not d.kv.holds(rid) and rid not in d.sched.requests
        reason = req.finish_reason
        if reason == "abort":
            return
        assert d.finish[rid] == (reason, req.stop_reason)
        sp = req.sampling_params
        if reason == "length":
            assert len(out) == req.max_tokens
            early = [t for t in out[max(sp.min_tokens - 1, 0) :] if t in sp.stop_token_ids or (t == EOS and not sp.ignore_eos)]
            assert not early
        else:
            assert reason == "stop" and len(out) >= sp.min_tokens and len(out) <= req.max_tokens
            early = [t for t in out[max(sp.min_tokens - 1, 0) : -1] if t in sp.stop_token_ids or t == EOS and not sp.ignore_eos]
            assert not early
            last = out[-1]
            assert last in sp.stop_token_ids or (last == EOS and not sp.ignore_eos)
            assert req.stop_reason == (None if last == EOS and not sp.ignore_eos else last)

    def teardown(self):
        d = getattr(self, "d", None)
        if d is None:
            return
        live = list(d.sched.requests)
        # Every request finishes in bounded steps: at worst one token a step, recomputed per preemption.
        bound = 50 + sum(r.num_prompt_tokens + r.max_tokens for r in d.sched.requests.values()) * 8
        steps = 0
        while d.sched.has_unfinished():
            assert steps < bound, "requests did not finish"
            d.step()
            self.check_blocks()
            steps += 1
        for rid in live:
            self.check_finished(rid)
            assert d.reqs[rid].finish_reason in ("stop", "length")
        d.step()  # reports the last finished ids
        d.check_all_free()
        assert not d.tables


SchedulerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestScheduler = SchedulerMachine.TestCase
