"""Property tests of scheduler + KV cache manager + block pool: random arrivals with shared prefixes, random
aborts, small pools that force preemption, both policies, with and without prefix caching, random budgets.

The Driver (tests/helpers/scheduler.py) checks on every step: the budget, max_num_seqs, the scheduler output
against the runner's view of block tables, and a model of the KV contents (no request reads KV that was
not computed for its own token prefix; every block in the hash map holds what its hash names)."""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.config import SchedulingPolicy
from kvrelay.engine.request import Request
from tests.helpers.scheduler import EOS, Driver

BASES = [[(7 * i + 3 * k) % 23 + 3 for i in range(64)] for k in range(2)]  # shared-prefix sources
STOP_ID = 5
RIDS = [f"r{i}" for i in range(12)]  # a small id space: ids are reused after a request ends


def sampled_token(rid: str, index: int) -> int:
    """The token the fake model samples as output `index` of request `rid` (EOS and STOP_ID now and then)."""
    return zlib.crc32(f"{rid}/{index}".encode()) % 60


def token_fn(req: Request) -> int:
    return sampled_token(req.request_id, req.num_output_tokens)


def is_stop(token: int, sp: SamplingParams) -> bool:
    return token in sp.stop_token_ids or (token == EOS and not sp.ignore_eos)


def driver_args(num_blocks: tuple[int, int], budget: tuple[int, int], max_num_seqs: tuple[int, int] = (1, 6),
                block_sizes: tuple[int, ...] = (1, 2, 4, 8), long_prefill: tuple[int, ...] | None = None) -> dict:
    """Strategies for a Driver's pool, budget, sequence limit, policy and caching, by its argument names
    (integer ranges inclusive)."""
    args = dict(
        block_size=st.sampled_from(block_sizes),
        num_blocks=st.integers(*num_blocks),
        budget=st.integers(*budget),
        max_num_seqs=st.integers(*max_num_seqs),
        policy=st.sampled_from(list(SchedulingPolicy)),
        caching=st.sampled_from([True, True, False]),
    )
    if long_prefill is not None:
        args["long_prefill"] = st.sampled_from(long_prefill)
    return args


class DriverMachine(RuleBasedStateMachine):
    """What the Driver state machines share: steps and aborts, the blocks checked after each step, and every
    finished request checked by `check_finished`."""

    d: Driver

    def check_finished(self, rid: str) -> None:
        raise NotImplementedError

    @rule(data=st.data())
    def abort(self, data):
        if not self.d.sched.requests:
            assert self.d.abort("unknown") == []
            return
        rid = data.draw(st.sampled_from(sorted(self.d.sched.requests)), label="abort")
        assert self.d.abort(rid) == [rid]
        self.check_finished(rid)

    @rule(n=st.integers(1, 6))
    def step(self, n):
        for _ in range(n):
            self.d.step()
            self.check_blocks()
            for rid in list(self.d.finish):
                if rid not in self.d.sched.requests:
                    self.check_finished(rid)

    @invariant()
    def check_blocks(self):
        d = self.d
        d.check_blocks()
        assert sum(b.ref_cnt for b in d.pool.blocks) == sum(len(v) for v in d.kv.req_to_blocks.values())

    def run_to_end(self, slack: int) -> None:
        """Step until every request has finished, within a bound: at worst one token a step, recomputed per
        preemption; then one more step, which reports the last finished ids."""
        d = self.d
        bound = slack + sum(r.num_prompt_tokens + r.max_tokens for r in d.sched.requests.values()) * 8
        steps = 0
        while d.sched.has_unfinished():
            assert steps < bound, "requests did not finish"
            d.step()
            self.check_blocks()
            steps += 1
        d.step()


class SchedulerMachine(DriverMachine):
    @initialize(**driver_args(num_blocks=(3, 14), budget=(1, 48), long_prefill=(0, 0, 3, 8)), data=st.data())
    def setup(self, data, **driver):
        self.d = Driver(token_fn=token_fn, **driver)
        self.max_prompt = min(self.d.max_model_len - 1, 40)
        self.add_requests(data)

    @rule(data=st.data())
    def add_requests(self, data):
        for _ in range(data.draw(st.integers(1, 4), label="arrivals")):
            self.add_one(data)

    def add_one(self, data):
        d = self.d
        free_ids = [r for r in RIDS if r not in d.sched.requests]
        if not free_ids:
            return
        rid = data.draw(st.sampled_from(free_ids), label="rid")
        base = data.draw(st.sampled_from(BASES), label="base")
        n_shared = data.draw(
            st.sampled_from([0, self.max_prompt // 2, self.max_prompt]) | st.integers(0, self.max_prompt),
            label="shared",
        )
        n_own = data.draw(st.integers(0 if n_shared else 1, self.max_prompt - n_shared), label="own")
        own = data.draw(st.lists(st.integers(0, 99), min_size=n_own, max_size=n_own), label="own_tokens")
        d.add(
            rid,
            base[:n_shared] + own,
            max_tokens=data.draw(st.integers(1, 12), label="max_tokens"),
            priority=data.draw(st.integers(0, 3), label="priority"),
            salt=data.draw(st.sampled_from(["", "", "", "t1"]), label="salt"),
            stop_token_ids=data.draw(st.sampled_from([(), (STOP_ID,)]), label="stop"),
            ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
            min_tokens=data.draw(st.integers(0, 1), label="min_tokens"),
        )

    @invariant()
    def check_blocks(self):
        super().check_blocks()
        d = self.d
        assert len(d.sched.running) <= d.config.max_num_seqs
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
            # Length is checked first (as in vLLM): only the last token may be a stop token.
            assert not any(is_stop(t, sp) for t in out[max(sp.min_tokens - 1, 0) : -1])
        else:
            assert reason == "stop" and len(out) >= sp.min_tokens and len(out) <= req.max_tokens
            assert not any(is_stop(t, sp) for t in out[max(sp.min_tokens - 1, 0) : -1])
            last = out[-1]
            assert is_stop(last, sp)
            assert req.stop_reason == (None if last == EOS and not sp.ignore_eos else last)

    def teardown(self):
        d = getattr(self, "d", None)
        if d is None:
            return
        live = list(d.sched.requests)
        self.run_to_end(slack=50)
        for rid in live:
            self.check_finished(rid)
            assert d.reqs[rid].finish_reason in ("stop", "length")
        stats = d.sched.counters
        event(f"preemptions: {'yes' if stats.num_preemptions else 'no'}")
        event(f"prefix hits: {'yes' if stats.prefix_cache_hits else 'no'}")
        event(f"requests: {len(d.reqs)}")
        d.check_all_free()
        assert not d.tables


SchedulerMachine.TestCase.settings = settings(
    max_examples=75,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestScheduler = SchedulerMachine.TestCase


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    low_prompt=st.integers(8, 32),
    extra_blocks=st.integers(1, 4),
    long_prefill=st.sampled_from([2, 4, 8]),
    spare_budget=st.integers(1, 8),
    highs=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2)), min_size=1, max_size=3),
)
def test_priority_preemption_mid_prefill(block_size, low_prompt, extra_blocks, long_prefill, spare_budget, highs):
    """A low-priority long prompt prefills in chunks while higher-priority requests arrive and decode in a
    pool with little room: the scheduler preempts the low one in steps where it already scheduled (and
    hashed) a chunk. No KV that was never computed may become a prefix hit, and every request still
    finishes with all its tokens."""
    d = Driver(
        num_blocks=-(-low_prompt // block_size) + extra_blocks,
        block_size=block_size,
        budget=long_prefill + spare_budget,
        long_prefill=long_prefill,
        policy=SchedulingPolicy.PRIORITY,
        token_fn=token_fn,
    )
    base = BASES[0]
    d.add("low", base[:low_prompt], max_tokens=2, priority=3)
    d.step()
    for i, (n, max_tokens, steps) in enumerate(highs):
        d.add(f"high{i}", BASES[1][:n], max_tokens=max_tokens, priority=0)
        for _ in range(steps + 1):
            d.step()
    d.run(max_steps=500)
    # The same prompt again: it hits whatever the low-priority request left in the cache.
    d.add("again", base[:low_prompt], max_tokens=2, priority=1)
    d.run(max_steps=500)
    d.step()
    d.check_all_free()
    for rid, req in d.reqs.items():
        assert d.outputs[rid] == [sampled_token(rid, i) for i in range(len(d.outputs[rid]))]
        assert req.finish_reason in ("stop", "length")
