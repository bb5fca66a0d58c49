"""Property tests of speculative decoding and beam search in the scheduler, KV cache manager and block pool:
random arrivals with shared prefixes, random aborts, small pools that force preemption, both policies, with
and without prefix caching, random budgets (the Driver's checks run on every step: budget, block tables
against the runner's view, and the KV model: no request reads KV not computed for its own tokens, no two
requests write one slot, every hashed block holds what its hash names).

Speculation: a fake proposer drafts some right tokens then maybe a wrong one; the output must be exactly
the tokens without speculation, never past max_tokens or a stop token, with exact ref counts and nothing
leaked. Beam search: beams fork by reference and copy the shared partial block before writing it; after
groups finish or are aborted every block is free, and each finished group's beams are what the same beam
search gives run on its own.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvrelay.common.sampling_params import BeamSearchParams, SamplingParams
from kvrelay.engine.beam_search import Beam, BeamGroup, num_candidates
from kvrelay.engine.request import Request, RequestStatus
from tests.engine.test_scheduler_properties import BASES, STOP_ID, DriverMachine, driver_args, is_stop, sampled_token
from tests.helpers.scheduler import EOS, Driver

RIDS = [f"r{i}" for i in range(10)]
GIDS = [f"g{i}" for i in range(4)]


def _crc(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


# -- speculative decoding -------------------------------------------------------------------------------


def make_proposer(k: int):
    def propose(req: Request, new_tokens: tuple[int, ...]) -> list[int]:
        """Up to k drafts for the outputs after this step's: a run of right ones, then maybe a wrong one."""
        start = req.num_output_tokens + len(new_tokens)
        h = _crc(req.request_id, start)
        right = [sampled_token(req.request_id, start + j) for j in range(h % (k + 1))]
        if len(right) < k and h % 3:
            right.append((sampled_token(req.request_id, start + len(right)) + 1) % 60)
        return right

    return propose


class SpecMachine(DriverMachine):
    @initialize(**driver_args(num_blocks=(6, 16), budget=(1, 32), long_prefill=(0, 0, 3)), k=st.integers(1, 4),
                spec_lookahead=st.sampled_from([0, 0, 1, 3]), data=st.data())
    def setup(self, data, k, **driver):
        self.d = Driver(propose_fn=make_proposer(k), token_at=lambda req, i: sampled_token(req.request_id, i),
                        **driver)
        self.max_prompt = max(1, min(self.d.max_model_len - 1 - driver["spec_lookahead"], 30))
        self.add_requests(data)

    @rule(data=st.data())
    def add_requests(self, data):
        d = self.d
        for _ in range(data.draw(st.integers(1, 3), label="arrivals")):
            free = [r for r in RIDS if r not in d.sched.requests]
            if not free:
                return
            rid = data.draw(st.sampled_from(free), label="rid")
            n_shared = data.draw(st.integers(0, self.max_prompt), label="shared")
            n_own = data.draw(st.integers(0 if n_shared else 1, self.max_prompt - n_shared), label="own")
            own = data.draw(st.lists(st.integers(0, 99), min_size=n_own, max_size=n_own), label="own_tokens")
            max_tokens = data.draw(st.integers(1, 14), label="max_tokens")
            d.add(rid, BASES[0][:n_shared] + own, max_tokens=max_tokens,
                  priority=data.draw(st.integers(0, 3), label="priority"),
                  stop_token_ids=data.draw(st.sampled_from([(), (STOP_ID,)]), label="stop"),
                  ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
                  min_tokens=data.draw(st.integers(0, min(2, max_tokens)), label="min_tokens"),
                  seed=data.draw(st.sampled_from([None, 7]), label="seed"),
                  temperature=data.draw(st.sampled_from([0.0, 1.0]), label="temperature"))

    @invariant()
    def check_blocks(self):
        super().check_blocks()
        c = self.d.sched.counters
        assert c.spec_num_accepted_tokens <= c.spec_num_draft_tokens
        assert sum(c.spec_accepted_per_pos) == c.spec_num_accepted_tokens

    def check_finished(self, rid: str) -> None:
        d, req = self.d, self.d.reqs[rid]
        out = d.outputs[rid]
        assert out == [sampled_token(rid, i) for i in range(len(out))], "speculation changed the tokens"
        assert out == req.output_token_ids and not d.kv.holds(rid)
        sp = req.sampling_params
        assert len(out) <= req.max_tokens
        # Nothing after a stop token (min_tokens aside), whatever the drafts said.
        assert not any(is_stop(t, sp) for t in out[max(sp.min_tokens - 1, 0) : -1])
        if req.finish_reason == "length":
            assert len(out) == req.max_tokens

    def teardown(self):
        d = getattr(self, "d", None)
        if d is None:
            return
        self.run_to_end(slack=60)
        for rid in d.finish:
            self.check_finished(rid)
        d.check_all_free()


TestSpecMachine = SpecMachine.TestCase
TestSpecMachine.settings = settings(max_examples=150, stateful_step_count=20, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


# -- beam search ----------------------------------------------------------------------------------------


def candidates(tokens: tuple[int, ...], count: int) -> list[tuple[int, float]]:
    """A fake model's top `count` (token, logprob) after `tokens`, best first; EOS now and then."""
    h = _crc(*tokens[-6:], len(tokens))
    picked = list(dict.fromkeys((h >> (3 * i)) % 24 + 3 for i in range(count * 3)))[:count]
    while len(picked) < count:
        picked.append(40 + len(picked))
    if h % 4 == 0:
        picked[h % count] = EOS
    picked = list(dict.fromkeys(picked))
    while len(picked) < count:
        picked.append(50 + len(picked))
    lps = sorted((float(np.float32(-0.05 - ((h >> i) % 97) / 40.0)) for i in range(count)), reverse=True)
    return list(zip(picked, lps))


def beam_fn(driver: Driver):
    def fn(req: Request) -> list[tuple[int, float]]:
        group = driver.sched.beam_groups[req.beam_group]
        return candidates(tuple(req.all_token_ids), group.num_candidates)

    return fn


def add_group(d: Driver, gid: str, prompt: list[int], params: BeamSearchParams) -> None:
    """What EngineCore.add_beam_search does, on the Driver's scheduler."""
    end_ids = () if params.ignore_eos else (EOS,)
    max_new = min(params.max_tokens, d.max_model_len - len(prompt))
    root = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True,
                          logprobs=num_candidates(params.beam_width, len(end_ids)))
    req = Request(f"{gid}:beam0", prompt, root, arrival_time=float(next(d.arrival)))
    d.sched.add_beam_group(BeamGroup(gid, params, len(prompt), end_ids, max_new), req)


def reference_beams(prompt: list[int], params: BeamSearchParams, end_ids: tuple[int, ...], max_new: int):
    """The same beam search with no scheduler, blocks or preemption: beams as token lists."""
    group = BeamGroup("ref", params, len(prompt), end_ids, max_new)
    group.beams = [Beam(SimpleNamespace(request_id="ref:0", output_token_ids=[]), np.float32(0.0))]
    while True:
        for b in group.beams:
            group.record(b.req.request_id, candidates((*prompt, *b.req.output_token_ids), group.num_candidates))
        step = group.step()
        if step.done:
            return group.results()
        by_id = {b.req.request_id: b.req for b in group.beams}
        group.beams = [Beam(SimpleNamespace(request_id=f"ref:{i}", output_token_ids=[*by_id[p].output_token_ids, t]),
                            score) for i, (p, t, score) in enumerate(step.next_beams)]


class BeamMachine(RuleBasedStateMachine):
    @initialize(**driver_args(num_blocks=(8, 24), budget=(1, 24), max_num_seqs=(3, 8), block_sizes=(1, 2, 4)),
                data=st.data())
    def setup(self, data, **driver):
        self.d = Driver(token_fn=lambda req: sampled_token(req.request_id, req.num_output_tokens), **driver)
        self.d.beam_fn = beam_fn(self.d)
        self.groups: dict[str, tuple[list[int], BeamSearchParams]] = {}
        self.add_group(data)

    @rule(data=st.data())
    def add_group(self, data):
        d = self.d
        free = [g for g in GIDS if g not in d.sched.beam_groups and g not in self.groups]
        if not free:
            return
        gid = data.draw(st.sampled_from(free), label="gid")
        width = data.draw(st.integers(1, min(3, d.config.max_num_seqs)), label="width")
        max_tokens = data.draw(st.integers(1, 6), label="max_tokens")
        prompt_len = data.draw(st.integers(1, 12), label="prompt_len")
        if width * -(-(prompt_len + max_tokens) // d.bs) > d.pool.num_blocks:
            return  # EngineCore refuses a group that could not fit the pool on its own
        prompt = BASES[data.draw(st.integers(0, 1), label="base")][:prompt_len]
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                  length_penalty=data.draw(st.sampled_from([0.0, 1.0, 2.0]), label="lp"),
                                  early_stopping=data.draw(st.sampled_from([False, True, "never"]), label="es"),
                                  ignore_eos=data.draw(st.booleans(), label="ignore_eos"))
        add_group(d, gid, prompt, params)
        self.groups[gid] = (prompt, params)

    @rule(data=st.data())
    def add_request(self, data):
        free = [r for r in RIDS[:4] if r not in self.d.sched.requests]
        if free:
            rid = data.draw(st.sampled_from(free), label="rid")
            longest = min(10, self.d.max_model_len - 1)  # EngineCore refuses longer prompts
            self.d.add(rid, BASES[1][: data.draw(st.integers(1, longest), label="len")],
                       max_tokens=data.draw(st.integers(1, 6), label="max_tokens"))

    @rule(data=st.data())
    def abort(self, data):
        d = self.d
        live = sorted(d.sched.beam_groups)
        if not live:
            return
        gid = data.draw(st.sampled_from(live), label="abort")
        members = [m.request_id for m in d.sched.beam_groups[gid].members()]
        if data.draw(st.booleans(), label="by_member"):
            d.abort(data.draw(st.sampled_from(members), label="member"))  # one beam ends the whole group
        else:
            assert d.sched.abort_beam_groups([gid]) == [gid]
        assert gid not in d.sched.beam_groups
        assert not any(r.beam_group == gid for r in d.sched.requests.values())
        del self.groups[gid]

    @rule(n=st.integers(1, 6))
    def step(self, n):
        for _ in range(n):
            self.d.step()
            self.check_blocks()
            self.check_results()

    @invariant()
    def check_blocks(self):
        d = self.d
        d.check_blocks()
        assert sum(b.ref_cnt for b in d.pool.blocks) == sum(len(v) for v in d.kv.req_to_blocks.values())
        assert len(d.sched.running) <= d.config.max_num_seqs
        for group in d.sched.beam_groups.values():
            members = group.members()
            assert 1 <= len(members) <= group.width
            statuses = {m.status for m in members}
            # A group is all running or all waiting: it is preempted and admitted as one.
            assert statuses <= {RequestStatus.RUNNING} or statuses <= {RequestStatus.WAITING, RequestStatus.PREEMPTED}

    def check_results(self):
        d = self.d
        for gid, beams in list(d.beam_results.items()):
            del d.beam_results[gid]  # ids are reused
            prompt, params = self.groups.pop(gid)
            end_ids = () if params.ignore_eos else (EOS,)
            max_new = min(params.max_tokens, d.max_model_len - len(prompt))
            assert beams == reference_beams(prompt, params, end_ids, max_new)
            assert len(beams) == params.beam_width
            assert not any(r.beam_group == gid for r in d.sched.requests.values())

    def teardown(self):
        d = getattr(self, "d", None)
        if d is None:
            return
        steps = 0
        while d.sched.has_unfinished():
            d.step()
            steps += 1
            assert steps <= 2000, "beam groups did not finish"
        self.check_results()
        assert not self.groups, f"groups never finished: {sorted(self.groups)}"
        d.step()
        d.check_all_free()


TestBeamMachine = BeamMachine.TestCase
TestBeamMachine.settings = settings(max_examples=150, stateful_step_count=20, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
