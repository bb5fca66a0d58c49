"""Scheduler behaviour, driven without a model: chunked prefill, budgets, prefix hits, preemption, abort,
stop conditions. A fake runner mirrors what the model runner keeps (block tables from the scheduler
output) and what the KV cache would hold (per slot, a key for the token prefix written there), so that
every step also checks that each request only attends to KV computed for its own tokens."""

from __future__ import annotations

import pytest

from kvrelay.engine.request import RequestStatus
from kvrelay.engine.scheduler_output import ModelRunnerOutput
from tests.helpers.scheduler import EOS, FCFS, PRIORITY, SJF, Driver, prompt, tokens_then


def test_chunked_prefill_32_32_16_and_only_the_last_chunk_samples():
    d = Driver(budget=32, block_size=16)
    d.add("a", prompt(80), max_tokens=3)
    out1, s1 = d.step()
    assert dict(out1.num_scheduled_tokens) == {"a": 32} and s1 == {}
    (new,) = out1.new_reqs
    assert new.num_computed_tokens == 0 and new.block_ids == (0, 1) and out1.cached_reqs == ()
    out2, s2 = d.step()
    assert dict(out2.num_scheduled_tokens) == {"a": 32} and s2 == {}
    (c2,) = out2.cached_reqs
    assert c2.num_computed_tokens == 32 and c2.new_block_ids == (2, 3) and out2.new_reqs == ()
    out3, s3 = d.step()
    assert dict(out3.num_scheduled_tokens) == {"a": 16} and s3 == {"a": 1000}
    (c3,) = out3.cached_reqs
    assert c3.num_computed_tokens == 64 and c3.new_block_ids == (4,)
    assert d.outputs["a"] == [1000]
    # Decodes: one token a step; token 81 opens a block (80 tokens fill 5 blocks exactly).
    out4, _ = d.step()
    assert dict(out4.num_scheduled_tokens) == {"a": 1} and out4.cached_reqs[0].new_block_ids == (5,)
    d.run()
    assert d.outputs["a"] == [1000, 1001, 1002] and d.finish["a"] == ("length", None)
    d.check_all_free()


def test_long_prefill_threshold_caps_a_chunk():
    d = Driver(budget=100, long_prefill=24)
    d.add("a", prompt(50), max_tokens=1)
    chunks = [dict(o.num_scheduled_tokens)["a"] for o in d.run()]
    assert chunks == [24, 24, 2]


def test_without_chunked_prefill_prompts_are_scheduled_whole():
    d = Driver(budget=32, chunked=False)
    d.add("a", prompt(20), max_tokens=2)
    d.add("b", prompt(20, 100), max_tokens=2)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 20}  # b would only fit as a 12-token chunk
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 20}
    d.run()
    d.check_all_free()


def test_decodes_are_scheduled_before_new_prompts():
    d = Driver(budget=32)
    d.add("a", prompt(10), max_tokens=10)
    d.add("b", prompt(10, 100), max_tokens=10)
    d.step()
    d.add("c", prompt(60, 200), max_tokens=2)
    out, _ = d.step()
    # The running decodes take their token first; the new prompt gets what is left.
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 1, "c": 30}
    assert [c.req_id for c in out.cached_reqs] == ["a", "b"] and [n.req_id for n in out.new_reqs] == ["c"]
    # Next step c's unfinished prefill chunk is a running request too, served in admission order.
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 1, "c": 30}
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 1, "c": 1}


def test_a_budget_spent_on_decodes_admits_nothing():
    d = Driver(budget=3)
    for i in range(3):
        d.add(f"r{i}", prompt(1, 10 * i + 10), max_tokens=5)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"r0": 1, "r1": 1, "r2": 1}
    d.add("late", prompt(4, 500), max_tokens=1)
    for _ in range(4):
        out, _ = d.step()
        assert "late" not in out.num_scheduled_tokens and out.total_num_scheduled_tokens == 3
    assert d.reqs["late"].status == RequestStatus.WAITING
    out, _ = d.step()  # the decodes finished with their 5th token
    assert dict(out.num_scheduled_tokens) == {"late": 3}
    d.run()
    assert d.finish["late"] == ("length", None)
    d.check_all_free()


def test_max_num_seqs():
    d = Driver(max_num_seqs=2)
    d.add("a", prompt(5), max_tokens=2)
    d.add("b", prompt(5, 50), max_tokens=4)
    d.add("c", prompt(5, 90), max_tokens=2)
    out, _ = d.step()
    assert set(out.num_scheduled_tokens) == {"a", "b"} and len(d.sched.running) == 2
    out, _ = d.step()  # a finishes here
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    out, _ = d.step()
    assert set(out.num_scheduled_tokens) == {"b", "c"} and out.finished_req_ids == {"a"}
    assert [n.req_id for n in out.new_reqs] == ["c"]
    d.run()
    d.check_all_free()


# -- prefix cache -------------------------------------------------------------------------------------


def test_prefix_cache_hits_count_as_computed_tokens():
    d = Driver(block_size=16)
    shared = prompt(48, 300)
    d.add("a", shared + [1, 2, 3, 4, 5], max_tokens=2)
    d.run()
    assert d.sched.counters.prefix_cache_hits == 0 and d.sched.counters.prefix_cache_queries == 53
    d.add("b", shared + [7, 8, 9], max_tokens=2)
    out, _ = d.step()
    (new,) = out.new_reqs
    assert new.num_computed_tokens == 48 and out.num_scheduled_tokens["b"] == 3
    assert new.block_ids[:3] == tuple(d.kv.block_ids("b")[:3])
    assert d.reqs["b"].num_cached_tokens == 48
    assert d.sched.counters.prefix_cache_hits == 48 and d.sched.counters.prefix_cache_queries == 53 + 51
    d.run()
    # Every output of b reports the hit.
    assert d.finish["b"] == ("length", None)
    # A prompt equal to the cached prefix recomputes its last block.
    d.add("c", list(shared), max_tokens=1)
    out, _ = d.step()
    assert out.new_reqs[0].num_computed_tokens == 32 and out.num_scheduled_tokens["c"] == 16
    d.run()
    d.check_all_free()


def test_prefix_hit_reported_in_outputs():
    d = Driver()
    d.add("a", prompt(40), max_tokens=1)
    d.run()
    d.add("b", prompt(40), max_tokens=2)
    out = d.sched.schedule()
    eos = d.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"b": (7,)}))
    assert eos[0].num_cached_tokens == 32 and eos[0].num_prompt_tokens == 40


def test_no_prefix_hits_without_caching():
    d = Driver(caching=False)
    d.add("a", prompt(48), max_tokens=2)
    d.run()
    d.add("b", prompt(48), max_tokens=2)
    out, _ = d.step()
    assert out.new_reqs[0].num_computed_tokens == 0 and d.sched.counters.prefix_cache_hits == 0
    d.run()
    d.check_all_free()
    assert d.pool.cached == {}


# -- preemption -----------------------------------------------------------------------------------------


# These fill the cache on purpose: without admission headroom, so that growing requests must preempt.


def test_preemption_fcfs_preempts_the_latest_arrival_and_it_resumes():
    d = Driver(num_blocks=6, block_size=4, caching=False, headroom=False)
    a = d.add("a", prompt(8), max_tokens=6)
    b = d.add("b", prompt(8, 100), max_tokens=6)
    c = d.add("c", prompt(7, 200), max_tokens=6)
    out, _ = d.step()
    assert d.kv.block_ids("a") == [0, 1] and d.kv.block_ids("b") == [2, 3] and d.kv.block_ids("c") == [4, 5]
    assert d.pool.num_free_blocks == 0
    out, _ = d.step()
    # a needs a third block: c (latest arrival) is preempted and its blocks go to a and b.
    assert out.preempted_req_ids == {"c"} and set(out.num_scheduled_tokens) == {"a", "b"}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert not d.kv.holds("c") and c not in d.sched.running and len(d.sched.waiting) == 1
    assert d.kv.block_ids("a") == [0, 1, 5] and d.kv.block_ids("b") == [2, 3, 4]
    assert d.sched.counters.num_preemptions == 1
    assert a.status == b.status == RequestStatus.RUNNING
    outs = d.run()
    # c resumes with its prompt plus the token it had, recomputed from scratch.
    resumed = next(n for o in outs for n in o.new_reqs if n.req_id == "c")
    assert resumed.token_ids == tuple(prompt(7, 200)) + (1000,) and resumed.num_prompt_tokens == 7
    assert resumed.num_computed_tokens == 0
    for rid in "abc":
        assert d.outputs[rid] == [1000 + i for i in range(6)] and d.finish[rid] == ("length", None)
    assert d.reqs["c"].num_output_tokens == 6
    d.check_all_free()


def test_admission_headroom_waits_instead_of_preempting():
    """Three requests as above, a and b growing into exactly the rest of the cache: without the headroom c
    is admitted into it and then preempted; with it, c waits until a and b finish and nothing is computed
    twice."""
    d = Driver(num_blocks=6, block_size=4, caching=False)
    d.add("a", prompt(8), max_tokens=4)
    d.add("b", prompt(8, 100), max_tokens=4)
    d.add("c", prompt(7, 200), max_tokens=4)
    out, _ = d.step()
    # a, b take 2 blocks each; c's 2 would leave none for a and b to grow into (they need 1 each).
    assert [n.req_id for n in out.new_reqs] == ["a", "b"] and d.pool.num_free_blocks == 2
    scheduled = sum(out.num_scheduled_tokens.values())
    for o in d.run():
        scheduled += sum(o.num_scheduled_tokens.values())
        assert not o.preempted_req_ids
    assert d.sched.counters.num_preemptions == 0
    assert scheduled == 8 + 8 + 7 + 3 * 3  # every prompt once, every output but the last once
    for rid in "abc":
        assert d.outputs[rid] == [1000 + i for i in range(4)]
    d.check_all_free()
    greedy = Driver(num_blocks=6, block_size=4, caching=False, headroom=False)
    for rid, start in (("a", 0), ("b", 100), ("c", 200)):
        greedy.add(rid, prompt(7 if rid == "c" else 8, start), max_tokens=4)
    greedy.run()
    assert greedy.sched.counters.num_preemptions == 1


def test_admission_headroom_counts_the_rest_of_chunked_prompts():
    """A prompt prefilled in chunks still needs blocks for its next chunks: the headroom keeps them, so a
    later request is not admitted into them."""
    d = Driver(num_blocks=8, block_size=4, budget=8, caching=False)
    d.add("long", prompt(24), max_tokens=2)  # 6 blocks, 8 tokens a step
    d.add("short", prompt(4, 100), max_tokens=2)
    out, _ = d.step()
    # long: 2 blocks now, 4 more to come, plus 1 to grow: 5 of the 6 free blocks; short's 1 block would leave 5.
    assert [n.req_id for n in out.new_reqs] == ["long"]
    d.run()
    assert d.sched.counters.num_preemptions == 0
    assert d.outputs["long"] == [1000, 1001] and d.outputs["short"] == [1000, 1001]
    d.check_all_free()


def test_preempted_request_resumes_from_the_prefix_cache():
    d = Driver(num_blocks=6, block_size=4, caching=True)
    a = d.add("a", prompt(8), max_tokens=6)
    c = d.add("c", prompt(12, 200), max_tokens=6)
    d.step()
    assert d.kv.block_ids("a") == [0, 1] and d.kv.block_ids("c") == [2, 3, 4]
    out, _ = d.step()
    # a takes the last free block; c, the latest arrival, needs one more and preempts itself.
    assert out.preempted_req_ids == {"c"} and dict(out.num_scheduled_tokens) == {"a": 1}
    assert d.pool.free_queue.block_ids() == [4, 3, 2]  # tail first
    outs = d.run()
    # a's next block came from c's last block (evicting it); c's first two blocks were still cached.
    assert d.outputs["a"] == [1000 + i for i in range(6)] and a.num_preemptions == 0
    resumed = next(n for o in outs for n in o.new_reqs if n.req_id == "c")
    assert resumed.num_computed_tokens == 8 and resumed.block_ids[:2] == (2, 3)
    assert c.num_cached_tokens == 0  # the stat counts the first admission only
    assert d.outputs["c"] == [1000 + i for i in range(6)]
    d.check_all_free()


def test_preemption_priority_preempts_the_lowest_priority():
    d = Driver(num_blocks=6, block_size=4, policy=PRIORITY, caching=False, headroom=False)
    d.add("a", prompt(8), max_tokens=6, priority=5)  # arrives first, lowest priority
    d.add("b", prompt(8, 100), max_tokens=6, priority=0)
    d.add("c", prompt(7, 200), max_tokens=6, priority=1)
    out, _ = d.step()
    # Admitted by priority, not arrival.
    assert [n.req_id for n in out.new_reqs] == ["b", "c", "a"]
    out, _ = d.step()
    assert out.preempted_req_ids == {"a"} and set(out.num_scheduled_tokens) == {"b", "c"}
    assert d.reqs["a"].status == RequestStatus.PREEMPTED and not d.kv.holds("a")
    d.run()
    for rid in "abc":
        assert d.outputs[rid] == [1000 + i for i in range(6)]
    d.check_all_free()


def test_priority_admits_higher_priority_first_and_breaks_ties_by_arrival():
    d = Driver(policy=PRIORITY, max_num_seqs=1)
    for rid, prio in [("a", 3), ("b", 1), ("c", 3), ("d", 0), ("e", 1)]:
        d.add(rid, prompt(3, 100 + 10 * ord(rid)), max_tokens=1, priority=prio)
    order = [o.new_reqs[0].req_id for o in d.run() if o.new_reqs]
    assert order == ["d", "b", "e", "a", "c"]


def test_fcfs_admits_by_arrival():
    d = Driver(max_num_seqs=1)
    for rid, prio in [("a", 3), ("b", 1), ("c", 0)]:
        d.add(rid, prompt(3, 100 + 10 * ord(rid)), max_tokens=1, priority=prio)
    order = [o.new_reqs[0].req_id for o in d.run() if o.new_reqs]
    assert order == ["a", "b", "c"]


def test_sjf_admits_a_burst_shortest_prompt_first_and_equal_lengths_by_arrival():
    d = Driver(policy=SJF, max_num_seqs=1)
    for i, (rid, n) in enumerate([("a", 30), ("b", 5), ("c", 12), ("d", 5)]):
        d.add(rid, prompt(n, 100 * (i + 1)), max_tokens=1, arrival=0.001 * i)
    order = [o.new_reqs[0].req_id for o in d.run() if o.new_reqs]
    assert order == ["b", "d", "c", "a"]


def test_sjf_orders_by_priority_first_so_a_tenants_backlog_waits_behind_others_new_requests():
    # The gateway gives each request its tenant's count of requests in flight: tenant A's burst is 0, 1, 2, 3;
    # tenant B's later arrival (0 in flight) goes right after A's first, whatever the lengths.
    d = Driver(policy=SJF, max_num_seqs=1)
    for i in range(4):
        d.add(f"a{i}", prompt(5, 100 * (i + 1)), max_tokens=1, arrival=0.001 * i, priority=i)
    d.add("b0", prompt(30, 900), max_tokens=1, arrival=0.01, priority=0)
    order = [o.new_reqs[0].req_id for o in d.run() if o.new_reqs]
    assert order == ["a0", "b0", "a1", "a2", "a3"]


@pytest.mark.parametrize("policy", [SJF, PRIORITY])
def test_a_running_prompt_yields_its_chunks_to_a_waiting_request_that_outranks_it(policy):
    # "a" (priority 3) is mid-prompt when "b" (priority 0) arrives: b's whole prompt goes first, a takes what
    # is left of the 32-token budget, and keeps the 32 tokens it had computed.
    d = Driver(policy=policy, budget=32)
    d.add("a", prompt(96, 100), max_tokens=2, priority=3)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 32}
    d.add("b", prompt(20, 500), max_tokens=2, priority=0, arrival=1.0)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"b": 20, "a": 12}
    assert [n.req_id for n in out.new_reqs] == ["b"] and out.cached_reqs[0].num_computed_tokens == 32
    # An equal priority does not outrank: "c" waits for a's next chunk as under fcfs.
    d.add("c", prompt(20, 700), max_tokens=2, priority=3, arrival=2.0)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 32}
    d.run()
    assert all(len(d.outputs[r]) == 2 for r in "abc")
    d.check_all_free()


@pytest.mark.parametrize("policy", [SJF, PRIORITY])
def test_a_prompt_a_priority_class_behind_waits_for_the_next_step(policy):
    # "b" (0) and "b2" (7) are within the gap of 8 and share the step; "a" (8) is a class behind and waits,
    # though the budget had room for it.
    d = Driver(policy=policy, budget=2048, priority_step_gap=8)
    d.add("a", prompt(40, 100), max_tokens=2, priority=8)
    d.add("b", prompt(20, 500), max_tokens=2, priority=0, arrival=1.0)
    d.add("b2", prompt(20, 700), max_tokens=2, priority=7, arrival=2.0)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"b": 20, "b2": 20}
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"b": 1, "b2": 1, "a": 40}  # decodes, then a's whole prompt
    d.run()
    assert all(len(d.outputs[r]) == 2 for r in ("a", "b", "b2"))
    d.check_all_free()


@pytest.mark.parametrize("policy, gap", [(FCFS, 8), (SJF, 0)])
def test_fcfs_or_no_gap_lets_every_priority_share_a_step(policy, gap):
    d = Driver(policy=policy, priority_step_gap=gap)
    d.add("a", prompt(40, 100), max_tokens=1, priority=8)
    d.add("b", prompt(20, 500), max_tokens=1, priority=0, arrival=1.0)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 40, "b": 20}


def test_a_yielding_prompt_a_class_behind_sits_out_the_step_of_the_one_it_yields_to():
    # "a" (priority 9) is mid-prompt; "b" (0) arrives: under a gap of 8, a takes nothing of what b leaves.
    d = Driver(policy=SJF, budget=32, priority_step_gap=8)
    d.add("a", prompt(96, 100), max_tokens=1, priority=9)
    d.step()
    d.add("b", prompt(20, 500), max_tokens=1, priority=0, arrival=1.0)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"b": 20}
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 32}
    d.run()
    d.check_all_free()


def test_fcfs_never_lets_a_waiting_request_pass_a_running_prompt():
    d = Driver(policy=FCFS, budget=32)
    d.add("a", prompt(96, 100), max_tokens=1, priority=3)
    d.step()
    d.add("b", prompt(20, 500), max_tokens=1, priority=0, arrival=1.0)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"a": 32}


def test_sjf_lets_later_arrivals_pass_only_while_they_are_shorter_by_the_aging():
    # 10 tokens per second: "a" (40 tokens) can be passed by a 10-token prompt arriving within 3 s of it.
    d = Driver(policy=SJF, max_num_seqs=1, sjf_tokens_per_s=10)
    d.add("a", prompt(40, 100), max_tokens=1, arrival=0.0)
    d.add("b", prompt(10, 200), max_tokens=1, arrival=2.0)  # 10 + 20 < 40
    d.add("c", prompt(10, 300), max_tokens=1, arrival=3.5)  # 10 + 35 > 40
    order = [o.new_reqs[0].req_id for o in d.run() if o.new_reqs]
    assert order == ["b", "a", "c"]


def test_sjf_puts_a_preempted_request_back_by_its_own_key():
    d = Driver(num_blocks=6, block_size=4, policy=SJF, caching=False, headroom=False)
    d.add("a", prompt(8), max_tokens=6, arrival=0.0)
    d.add("b", prompt(8, 100), max_tokens=6, arrival=0.0001)
    d.add("c", prompt(7, 200), max_tokens=6, arrival=0.0002)
    out, _ = d.step()
    assert [n.req_id for n in out.new_reqs] == ["c", "a", "b"]
    out, _ = d.step()  # every request needs a block, two are left: the last admitted (b) makes room
    assert out.preempted_req_ids == {"b"}
    d.add("e", prompt(8, 300), max_tokens=1, arrival=0.5)  # same length, later: behind b
    steps = d.run()
    assert [o.preempted_req_ids for o in steps if o.preempted_req_ids] == [{"a"}]
    # a (8 tokens at 0 s), preempted in turn, goes back ahead of b (8 tokens at 0.1 ms); e is last.
    assert [n.req_id for o in steps for n in o.new_reqs] == ["a", "b", "e"]
    for rid in "abc":
        assert d.outputs[rid] == [1000 + i for i in range(6)]
    d.check_all_free()


def test_priority_preemption_of_an_already_scheduled_request():
    """A low-priority request admitted first is scheduled first in a step, then preempted in that same
    step for a higher-priority one: its tokens and budget are given back, and none of its blocks keeps a
    hash for KV that was never computed."""
    d = Driver(num_blocks=7, block_size=4, budget=16, long_prefill=8, policy=PRIORITY, caching=True, headroom=False,
               priority_step_gap=0)  # low, 9 behind, takes what high leaves of the step
    low = d.add("low", prompt(24), max_tokens=3, priority=9)
    d.step()  # low: tokens 0..7 in [0, 1]
    d.add("high", prompt(4, 100), max_tokens=6, priority=0)
    out, _ = d.step()  # low: tokens 8..15 in [2, 3]; high: 4 tokens in [4]
    assert dict(out.num_scheduled_tokens) == {"low": 8, "high": 4}
    out, _ = d.step()
    # low goes first (admitted first) and takes blocks 5 and 6 for tokens 16..23, hashing both; then high
    # needs a block, and low, the lowest priority, is preempted: its 8 tokens go back to the budget.
    assert out.preempted_req_ids == {"low"}
    assert dict(out.num_scheduled_tokens) == {"high": 1}
    assert [c.req_id for c in out.cached_reqs] == ["high"] and out.cached_reqs[0].new_block_ids == (6,)
    assert low.status == RequestStatus.PREEMPTED and not d.kv.holds("low") and low.num_computed_tokens == 0
    # Block 5 was never written: it must not be found by its hash.
    assert d.pool.blocks[5].block_hash is None
    assert all(blk.block_id != 5 for blk in d.pool.cached.values())
    d.run()
    assert d.outputs["low"] == [1000, 1001, 1002]
    assert d.outputs["high"] == [1000 + i for i in range(6)]
    d.check_all_free()


# -- abort ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [FCFS, PRIORITY])
def test_abort_everywhere_frees_blocks_and_is_reported(policy):
    d = Driver(num_blocks=12, block_size=4, budget=16, policy=policy)
    d.add("dec", prompt(5), max_tokens=50)
    d.add("pre", prompt(40, 100), max_tokens=5)
    d.add("wait", prompt(40, 200), max_tokens=5)
    out, _ = d.step()
    assert dict(out.num_scheduled_tokens) == {"dec": 5, "pre": 11}
    out, _ = d.step()
    assert d.reqs["pre"].num_computed_tokens == 26 < 40
    assert d.reqs["wait"].status == RequestStatus.WAITING
    free_before = d.pool.num_free_blocks
    held = len(d.kv.block_ids("pre")) + len(d.kv.block_ids("dec"))
    assert sorted(d.abort("wait", "pre", "dec", "unknown")) == ["dec", "pre", "wait"]
    assert d.pool.num_free_blocks == free_before + held == 12
    for rid in ("dec", "pre", "wait"):
        r = d.reqs[rid]
        assert r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
        assert not d.kv.holds(rid) and rid not in d.sched.requests
    assert d.abort("dec") == []  # already gone
    out, _ = d.step()
    assert out.finished_req_ids == {"dec", "pre", "wait"} and out.is_empty
    out, _ = d.step()
    assert out.finished_req_ids == frozenset()
    d.check_all_free()


def test_abort_between_schedule_and_update_drops_the_sample():
    d = Driver()
    d.add("a", prompt(5), max_tokens=5)
    out = d.sched.schedule()
    d.abort("a")
    assert d.sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": (9,)})) == []
    assert d.sched.schedule().finished_req_ids == {"a"}
    d.check_all_free()


def test_abort_preempted_request():
    d = Driver(num_blocks=6, block_size=4, caching=False, headroom=False)
    d.add("a", prompt(8), max_tokens=6)
    d.add("b", prompt(8, 100), max_tokens=6)
    d.add("c", prompt(7, 200), max_tokens=6)
    d.step()
    out, _ = d.step()
    assert out.preempted_req_ids == {"c"}
    assert d.abort("c") == ["c"]
    out, _ = d.step()
    assert "c" in out.finished_req_ids
    d.run()
    assert "c" not in d.finish and d.outputs["c"] == [1000]
    d.check_all_free()


def test_duplicate_request_id_rejected():
    d = Driver()
    d.add("a", prompt(3))
    with pytest.raises(ValueError, match="request_id"):
        d.add("a", prompt(3))


@pytest.mark.parametrize("policy", [FCFS, PRIORITY])
def test_request_id_reused_after_abort_while_waiting(policy):
    d = Driver(policy=policy)
    d.add("x", prompt(4), max_tokens=2)
    d.abort("x")
    d.add("x", prompt(6, 100), max_tokens=3)
    assert len(d.sched.waiting) == 1
    out, _ = d.step()
    (new,) = out.new_reqs
    assert new.token_ids == tuple(prompt(6, 100))
    d.run()
    assert d.outputs["x"] == [1000, 1001, 1002]
    d.check_all_free()


# -- stop conditions -------------------------------------------------------------------------------------


def test_eos_stops():
    d = Driver(token_fn=tokens_then([5, 6, EOS, 7]))
    d.add("a", prompt(3), max_tokens=10)
    d.run()
    assert d.outputs["a"] == [5, 6, EOS] and d.finish["a"] == ("stop", None)
    assert d.reqs["a"].stop_reason is None
    d.check_all_free()


def test_ignore_eos():
    d = Driver(token_fn=tokens_then([EOS, EOS, 5]))
    d.add("a", prompt(3), max_tokens=4, ignore_eos=True)
    d.run()
    assert d.outputs["a"] == [EOS, EOS, 5, 1003] and d.finish["a"] == ("length", None)


def test_stop_token_ids_set_stop_reason():
    d = Driver(token_fn=tokens_then([5, 42, 6]))
    d.add("a", prompt(3), max_tokens=10, stop_token_ids=[41, 42])
    d.run()
    assert d.outputs["a"] == [5, 42] and d.finish["a"] == ("stop", 42)
    assert d.reqs["a"].stop_reason == 42 and d.reqs["a"].finish_reason == "stop"


def test_stop_token_ids_apply_with_ignore_eos():
    d = Driver(token_fn=tokens_then([EOS, 42]))
    d.add("a", prompt(3), max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    d.run()
    assert d.outputs["a"] == [EOS, 42] and d.finish["a"] == ("stop", 42)


def test_min_tokens_suppresses_early_stop():
    d = Driver(token_fn=tokens_then([EOS, 42, EOS, 42]))
    d.add("a", prompt(3), max_tokens=10, min_tokens=3, stop_token_ids=[42])
    d.run()
    # Stops at the first stop token once min_tokens outputs exist (the 3rd token counts).
    assert d.outputs["a"] == [EOS, 42, EOS] and d.finish["a"] == ("stop", None)
    d2 = Driver(token_fn=tokens_then([42, 42, 42]))
    d2.add("a", prompt(3), max_tokens=10, min_tokens=2, stop_token_ids=[42])
    d2.run()
    assert d2.outputs["a"] == [42, 42] and d2.finish["a"] == ("stop", 42)


def test_max_tokens():
    d = Driver()
    d.add("a", prompt(3), max_tokens=1)
    d.add("b", prompt(3, 50), max_tokens=7)
    d.run()
    assert d.outputs["a"] == [1000] and d.finish["a"] == ("length", None)
    assert len(d.outputs["b"]) == 7 and d.finish["b"] == ("length", None)


def test_max_model_len_ends_with_length():
    d = Driver(max_model_len=20)
    # max_tokens=None: limited by the room left in max_model_len.
    d.add("a", prompt(15), max_tokens=None)
    d.run()
    assert len(d.outputs["a"]) == 5 and d.finish["a"] == ("length", None)
    # The scheduler enforces max_model_len even when max_tokens says otherwise.
    d2 = Driver(max_model_len=20)
    r = d2.add("b", prompt(15), max_tokens=100)
    r.max_tokens = 100
    d2.run()
    assert len(d2.outputs["b"]) == 5 and d2.finish["b"] == ("length", None)
    assert d2.reqs["b"].num_tokens == 20
    d2.check_all_free()


def test_finished_requests_are_reported_next_step_and_runner_state_is_consistent():
    d = Driver()
    d.add("a", prompt(3), max_tokens=1)
    d.add("b", prompt(3, 50), max_tokens=3)
    out, _ = d.step()
    assert out.finished_req_ids == frozenset()
    assert "a" in d.finish and "a" not in d.sched.requests and not d.kv.holds("a")
    out, _ = d.step()
    assert out.finished_req_ids == {"a"}
    d.run()
    d.check_all_free()


def test_stats():
    d = Driver(num_blocks=10, block_size=4)
    d.add("a", prompt(8), max_tokens=3)
    d.add("b", prompt(8, 100), max_tokens=3)
    d.sched.schedule()
    st = d.sched.load()
    assert st.num_running == 2 and st.num_waiting == 0 and st.kv_cache_usage == pytest.approx(0.4)


def test_length_wins_over_a_stop_token_at_the_limit():
    d = Driver(token_fn=tokens_then([5, 42]))
    d.add("a", prompt(3), max_tokens=2, stop_token_ids=[42])
    d.run()
    assert d.outputs["a"] == [5, 42] and d.finish["a"] == ("length", None)
