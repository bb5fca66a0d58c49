"""Sampler: exact greedy, support restriction, penalties, seeded reproducibility, logprobs, distribution."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvrelay.common.sampling_params import SamplingParams as SP
from kvrelay.engine.sampler import Sampler, SamplerOutput, SamplingRow, _narrow_supports, noise_seed


def row(params: SP, position: int = 0, prompt=(), output=(), suppress=()) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), position, tuple(suppress))


def sample(logits: torch.Tensor, rows, vocab_size: int | None = None, seed: int = 0) -> list[int]:
    return Sampler(vocab_size or logits.shape[1], seed=seed)(logits, rows).token_ids


def seeded_draws(logits_1d: torch.Tensor, params: SP, n: int) -> set[int]:
    """Tokens drawn for n distinct (seed, position) pairs, all in one batch."""
    rows = [row(replace(params, seed=s), position=3 * s + 1) for s in range(n)]
    return set(sample(logits_1d.expand(n, -1).contiguous(), rows))


def reference_support(logits_1d: torch.Tensor, p: SP) -> tuple[set[int], float]:
    """Allowed tokens by the definitions (float64), and how close any cut-off came to flipping."""
    x = logits_1d.double() / p.temperature
    probs = x.softmax(-1)
    margin = float((probs / probs.max() - p.min_p).abs().min()) if p.min_p else 1.0
    x[probs < p.min_p * probs.max()] = float("-inf")
    if p.top_k:
        x[x < x.topk(min(p.top_k, x.numel())).values[-1]] = float("-inf")
    order = x.argsort(descending=True)
    cum = x.softmax(-1)[order].cumsum(-1)
    if p.top_p < 1:
        margin = min(margin, float((cum - p.top_p).abs().min()))
    keep = int((cum < p.top_p).sum()) + 1  # the fewest leading tokens whose mass reaches p
    return {int(t) for t in order[:keep] if x[t] > float("-inf")}, margin


# -- greedy ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=g)
    logits[3, [7, 11, 200]] = 50.0
    out = Sampler(300)(logits, [row(SP(temperature=0)) for _ in range(8)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 7
    assert out.logprobs == [None] * 8


def test_mixed_batch_keeps_greedy_rows_exact_and_leaves_input_untouched():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 100, generator=g)
    before = logits.clone()
    rows = [
        row(SP(temperature=0 if i % 2 else 1.0, top_p=0.9, presence_penalty=0.5), output=[1, 2], suppress=[5])
        for i in range(6)
    ]
    out = sample(logits, rows)
    assert torch.equal(logits, before)
    processed = Sampler(100).processed_logits(logits, rows)
    for i in (1, 3, 5):
        assert out[i] == int(processed[i].argmax())


def test_empty_batch():
    assert Sampler(10)(torch.empty(0, 10), []) == SamplerOutput([], [])


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(4, 12)
    logits[:, 10:] = 100.0  # embedding padding past vocab_size=10
    rows = [row(SP(temperature=0)), row(SP(seed=1)), row(SP()), row(SP(top_k=3, top_p=0.5, seed=2))]
    assert all(t < 10 for t in sample(logits, rows, vocab_size=10))


def test_bfloat16_logits_are_accepted():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3).bfloat16()
    rows = [row(SP(temperature=0, logprobs=1)), row(SP(top_k=1, seed=3)), row(SP(temperature=0.01, seed=4))]
    out = Sampler(4)(logits, rows)
    assert out.token_ids == [1, 1, 1]
    assert out.logprobs[0].logprob == pytest.approx(float(logits[0].float().log_softmax(-1)[1]))


# -- support restriction --------------------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])  # distinct, decreasing


@pytest.mark.parametrize("k", [1, 2, 5])
def test_top_k_support(k):
    assert seeded_draws(LOGITS, SP(top_k=k), 400) == set(range(k))


def test_top_p_keeps_the_minimal_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for p, expected in [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3}), (1e-6, {0})]:
        assert seeded_draws(logits, SP(top_p=p), 300) == expected, p


def test_top_p_boundaries():
    # Equal logits give exact float masses of 1/4: mass exactly p is enough, so p=0.5 keeps two tokens.
    assert len(seeded_draws(torch.zeros(4), SP(top_p=0.5), 200)) == 2
    assert len(seeded_draws(torch.zeros(4), SP(top_p=0.75), 200)) == 3
    # 1 - p rounds to 1 in float32: the most likely token must still survive.
    logits = torch.linspace(-3, 3, 1000)
    assert seeded_draws(logits, SP(top_p=1e-9), 50) == {999}


@pytest.mark.parametrize("scale", [0.3, 1.5, 4.0, 12.0])
def test_windowed_supports_match_the_definition(scale):
    # Flat to peaked rows over V=3000: supports found in the 64 and 2048 windows and by the full sort.
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(32, 3000, generator=g) * scale
    logits[0, :100] = logits[1, 40:140] = 100.0  # a run of ties across the 64-token window
    logits[5, 30:] = logits[9, 100:] = float("-inf")  # as min_p leaves them: fewer than k survivors
    top_k = [50, 50, 0, 0, 5, 50, 100, 1500, 2999, 0, 20, 80] * 3
    top_p = [1.0, 1.0, 0.3, 0.9, 0.99, 1.0, 0.5, 0.9, 0.99, 0.7, 1.0, 0.95] * 3
    found, width = {}, {}
    for rows, ids, lgs in _narrow_supports(logits.clone(), top_k[:32], top_p[:32]):
        for r, i, lg in zip(rows.tolist(), ids, lgs):
            found[r], width[r] = set(i[lg > float("-inf")].tolist()), len(i)
    assert sorted(found) == list(range(32))
    assert width[5] == 64 and len(found[5]) == 30  # the 30 survivors are known complete in the first window
    assert len(found[0]) == 100 and len(found[1]) == 100  # top-k keeps every tie of the k-th value
    checked = 0
    for i in range(len(logits)):
        allowed, margin = reference_support(logits[i], SP(top_k=top_k[i], top_p=top_p[i]))
        if margin > 1e-5:
            assert found[i] == allowed, i
            checked += 1
    assert checked >= 28


def test_top_p_applies_to_the_top_k_survivors():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # Renormalised over the top 2: 4/7, 3/7; p=0.5 needs only the first, p=0.6 needs both.
    assert seeded_draws(logits, SP(top_k=2, top_p=0.5), 200) == {0}
    assert seeded_draws(logits, SP(top_k=2, top_p=0.6), 200) == {0, 1}


def test_min_p_support():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert seeded_draws(logits, SP(min_p=0.6), 200) == {0, 1}  # 0.3 >= 0.24, 0.2 < 0.24
    assert seeded_draws(logits, SP(min_p=0.2), 300) == {0, 1, 2, 3}


def test_low_temperature_concentrates_on_the_argmax():
    # At T=0.01 the runner-up has probability e^-50: it must never appear.
    assert seeded_draws(LOGITS, SP(temperature=0.01), 300) == {0}
    assert seeded_draws(LOGITS, SP(temperature=5.0), 2000) == set(range(8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(st.floats(-6, 6), min_size=2, max_size=40, unique=True),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.8]),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.01, 0.2, 0.7]),
    seed=st.integers(0, 2**40),
)
def test_sampled_token_is_always_in_the_reference_support(values, temperature, top_k, top_p, min_p, seed):
    logits = torch.tensor(values)
    assume(float(logits.sort().values.diff().min()) > 1e-3)
    params = SP(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    allowed, margin = reference_support(logits, params)
    assume(margin > 1e-4)  # stay clear of float32-vs-float64 boundary cases
    rows = [row(replace(params, seed=seed + i), position=i) for i in range(16)]
    assert set(sample(logits.expand(16, -1).contiguous(), rows)) <= allowed


# -- suppression and penalties --------------------------------------------------------------------------


def test_suppressed_tokens_are_never_sampled():
    logits = torch.zeros(64, 6)
    logits[:, 3] = 20.0
    logits[:, 4] = 19.0
    rows = [row(SP(seed=i) if i % 3 else SP(temperature=0), position=i, suppress=(3, 4, 99)) for i in range(64)]
    out = sample(logits, rows)
    assert 3 not in out and 4 not in out
    assert out[0] == 0  # greedy: lowest id among the remaining ties


def test_penalties_give_exact_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]] * 4)
    rows = [
        row(SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt=[0, 1, 5], output=[2, 2, 3]),
        row(SP(), prompt=[0, 1], output=[2, 2, 3]),
        # Presence and frequency only look at the output; the prompt token 0 is untouched.
        row(SP(presence_penalty=-1.0, frequency_penalty=1.0), prompt=[0], output=[4, 4, 4, 1]),
        row(SP(repetition_penalty=3.0, presence_penalty=1.0, frequency_penalty=1.0)),  # nothing seen yet
    ]
    got = Sampler(6).processed_logits(logits, rows)
    expected = torch.tensor([
        [2.0 / 2, -1.0 * 2, 0.5 / 2 - 2 * 0.5 - 0.25, -0.5 * 2 - 0.5 - 0.25, 3.0, 0.0],
        [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
        [2.0, -1.0 - 1.0 + 1.0, 0.5, -0.5, 3.0 - 3.0 + 1.0, 0.0],
        [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
    ])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_suppression_comes_before_penalties():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    rows = [row(SP(repetition_penalty=1.5, frequency_penalty=-2.0), output=[2], suppress=[2])]
    got = Sampler(3).processed_logits(logits, rows)
    assert got[0, 2] == float("-inf") and got[0, 0] == 1.0


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    assert sample(logits, [row(SP(temperature=0, presence_penalty=0.2), output=[0])]) == [1]
    assert sample(logits, [row(SP(temperature=0, repetition_penalty=1.2), prompt=[0])]) == [1]


# -- seeded reproducibility -----------------------------------------------------------------------------


def _other_rows(n: int, rng: random.Random) -> list[SamplingRow]:
    kinds = [
        SP(), SP(temperature=0), SP(top_p=0.8), SP(top_k=5, seed=rng.randrange(1000)), SP(min_p=0.1),
        SP(presence_penalty=1.0, repetition_penalty=1.3), SP(temperature=0.5, top_p=0.5, top_k=50),
    ]
    return [row(rng.choice(kinds), position=rng.randrange(100), output=[1, 2, 3], suppress=[0]) for _ in range(n)]


def test_seeded_rows_do_not_depend_on_the_batch():
    V = 500
    g = torch.Generator().manual_seed(2)
    targets = [
        (row(SP(seed=s, temperature=1.0), position=10 + s), torch.randn(V, generator=g) * 0.1) for s in range(6)
    ] + [
        (row(SP(seed=99, top_p=0.9, top_k=100), position=7), torch.randn(V, generator=g)),
        (row(SP(seed=5, min_p=0.05, temperature=0.8), position=7), torch.randn(V, generator=g)),
    ]
    alone = [sample(lg[None], [r]) for r, lg in targets]
    rng = random.Random(0)
    for trial in range(5):
        others = _other_rows(rng.randrange(0, 12), rng)
        batch = [(r, lg) for r, lg in targets] + [(o, torch.randn(V, generator=g)) for o in others]
        rng.shuffle(batch)
        out = sample(torch.stack([lg for _, lg in batch]), [r for r, _ in batch], seed=trial)
        for (r, _), tok in zip(batch, out):
            for (t, _), expected in zip(targets, alone):
                if r is t:
                    assert tok == expected[0]


def test_seeded_noise_is_bitwise_identical_whatever_the_batch():
    V = 4096
    s = Sampler(V)
    target = row(SP(seed=1234), position=77)
    ref = s._uniform_noise([target], torch.device("cpu"))[0]
    rng = random.Random(3)
    for _ in range(4):
        batch = _other_rows(rng.randrange(1, 9), rng) + [target]
        rng.shuffle(batch)
        noise = s._uniform_noise(batch, torch.device("cpu"))
        assert torch.equal(noise[batch.index(target)], ref)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(Sampler(V, seed=9)._uniform_noise([target], torch.device("cpu"))[0], ref)
    finally:
        torch.set_num_threads(threads)


def test_different_positions_and_seeds_draw_differently():
    V = 1000
    s = Sampler(V)
    cpu = torch.device("cpu")
    a, b, c = (s._uniform_noise([row(SP(seed=sd), position=p)], cpu)[0] for sd, p in [(1, 5), (1, 6), (2, 5)])
    assert not torch.equal(a, b) and not torch.equal(a, c)
    flat = torch.zeros(50, V)
    tokens = sample(flat, [row(SP(seed=1), position=p) for p in range(50)])
    assert len(set(tokens)) > 45
    assert len({noise_seed(1, p) for p in range(1000)} | {noise_seed(s, 0) for s in range(1000)}) == 1999


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.zeros(32, 1000)
    rows = [row(SP()) for _ in range(32)]
    first = Sampler(1000, seed=7)
    assert first(logits, rows).token_ids == Sampler(1000, seed=7)(logits, rows).token_ids
    assert first(logits, rows).token_ids != Sampler(1000, seed=7)(logits, rows).token_ids  # stream advances


# -- logprobs -------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks_and_sorted_top():
    V = 200
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, V, generator=g) * 3
    rows = [
        row(SP(temperature=0, logprobs=3, presence_penalty=2.0), output=list(range(0, 200, 2))),
        row(SP(logprobs=0, seed=1, temperature=2.0)),
        row(SP(seed=2)),
        row(SP(logprobs=20, top_k=30, seed=3, repetition_penalty=1.5), prompt=[1, 2, 3]),
        row(SP(logprobs=5, temperature=0)),
    ]
    out = Sampler(V)(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i, n in [(0, 3), (1, 0), (3, 20), (4, 5)]:
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-6)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        assert len(lp.top) == n
        assert [t for t, _ in lp.top] == ref[i].topk(n).indices.tolist()
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert vals == pytest.approx(ref[i].topk(n).values.tolist(), abs=1e-6)
    assert out.logprobs[4].rank == 1 and out.logprobs[4].top[0][0] == out.token_ids[4]


# -- the distribution -----------------------------------------------------------------------------------


def _chi_square(tokens: list[int], probs: torch.Tensor, support: list[int]) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=max(support) + 1).double()[support]
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "params",
    [SP(), SP(temperature=0.6), SP(temperature=2.0), SP(top_k=5), SP(top_p=0.8, temperature=1.5),
     SP(min_p=0.2, top_k=6, top_p=0.95)],
    ids=["T=1", "T=0.6", "T=2", "top_k", "top_p", "min_p+top_k+top_p"],
)
@pytest.mark.parametrize("seeded", [True, False])
def test_empirical_distribution_matches_the_renormalised_softmax(params, seeded):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0, 0.8, 1.5])
    allowed, _ = reference_support(logits, params)
    x = logits.double() / params.temperature
    x[[t for t in range(8) if t not in allowed]] = float("-inf")
    probs = x.softmax(-1)
    n = 3000
    rows = [row(replace(params, seed=i if seeded else None), position=i % 97) for i in range(n)]
    tokens = sample(logits.expand(n, -1).contiguous(), rows, seed=11)
    assert set(tokens) == allowed
    # At most 7 degrees of freedom: P(chi2 > 30) ~ 1e-4; the draws are fixed, so this is deterministic.
    assert _chi_square(tokens, probs[probs > 0], sorted(allowed)) < 30.0


def test_a_token_span_reads_its_window_of_the_list_without_copying_it():
    from kvrelay.engine.sampler import TokenSpan

    tokens = [5, 6, 7, 8, 9]
    span = TokenSpan(tokens, 1, 4)
    assert len(span) == 3 and list(span) == [6, 7, 8] and span == [6, 7, 8]
    assert (span[0], span[-1], span[1:]) == (6, 8, [7, 8])
    with pytest.raises(IndexError):
        span[3]
    tokens.append(10)  # the request's list grows after the row was made: the span still ends where it did
    assert list(span) == [6, 7, 8] and [*span, 99] == [6, 7, 8, 99]
    assert len(TokenSpan(tokens, 2, 2)) == 0
