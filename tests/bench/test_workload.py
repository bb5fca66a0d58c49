"""The throughput benchmark: workload determinism, FLOP counting, and a tiny end-to-end run."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import torch

from kvrelay.bench.workload import (
    WorkloadSpec,
    build_workload,
    corpus_tokens,
    fingerprint,
    iter_corpus_docs,
    send_poisson,
)
from kvrelay.engine.models.loader import compute_dtype


def _encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


SPEC = WorkloadSpec(num_requests=24, seed=7, input_len=(5, 300), output_len=(2, 40))


def test_corpus_is_real_text_in_a_fixed_order():
    docs = list(iter_corpus_docs())
    assert len(docs) > 100
    assert docs == list(iter_corpus_docs())
    assert sum(len(d) for d in docs) > 100_000
    assert "the" in docs[0].lower()


def test_corpus_repeats_up_to_min_tokens():
    stream = corpus_tokens(_encode, modules=("textwrap",))
    longer = corpus_tokens(_encode, min_tokens=3 * len(stream) + 1, modules=("textwrap",))
    assert len(longer) > 3 * len(stream)
    assert longer[: len(stream)] == stream


def test_same_seed_same_workload():
    a, b = build_workload(_encode, SPEC), build_workload(_encode, SPEC)
    assert a == b
    assert fingerprint(a) == fingerprint(b)


def test_other_seed_other_workload():
    other = WorkloadSpec(**{**SPEC.__dict__, "seed": 8})
    assert fingerprint(build_workload(_encode, other)) != fingerprint(build_workload(_encode, SPEC))


def test_prefix_of_a_longer_workload():
    longer = WorkloadSpec(**{**SPEC.__dict__, "num_requests": 40})
    assert build_workload(_encode, longer)[:24] == build_workload(_encode, SPEC)


def test_lengths_in_range_and_exact():
    reqs = build_workload(_encode, SPEC)
    assert [r.index for r in reqs] == list(range(SPEC.num_requests))
    assert all(5 <= r.input_len <= 300 for r in reqs)
    assert all(2 <= r.output_len <= 40 for r in reqs)
    stream = corpus_tokens(_encode, 2 * 300)
    for r in reqs:
        assert list(r.prompt_token_ids) == stream[r.offset : r.offset + r.input_len]
    assert len({r.input_len for r in reqs}) > 10  # mixed, not constant


def test_vocab_folding():
    reqs = build_workload(_encode, SPEC, vocab_size=100)
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_token_ids)


def test_bad_spec_is_rejected():
    with pytest.raises(ValueError, match="input"):
        WorkloadSpec(input_len=(10, 5))
    with pytest.raises(ValueError, match="num_requests"):
        WorkloadSpec(num_requests=0)


def test_flops_per_token_smollm2_shape():
    from kvrelay.bench.throughput import flops_per_token

    cfg = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152)
    f = flops_per_token(cfg)
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576
    assert f["non_embedding_params"] == 30 * per_layer + 576
    assert f["flops_per_token"] == 2 * f["non_embedding_params"] + 2 * 576 * 49152


def test_help_lists_every_flag(capsys):
    from kvrelay.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["bench", "throughput", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--dtype", "--num-requests", "--seed", "--max-num-batched-tokens", "--max-num-seqs",
                 "--kv-cache-memory", "--baseline", "--hf-batch-size", "--output", "--min-input", "--max-output"):
        assert flag in out


@pytest.mark.timeout(120)
def test_end_to_end_tiny_with_hf_baseline(tmp_path, capsys):
    from kvrelay.cli import main as cli_main
    from tests.helpers.models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny")
    out = tmp_path / "results" / "throughput.json"
    argv = ["--model", str(ckpt), "--num-requests", "4", "--min-input", "4", "--max-input", "24",
            "--min-output", "2", "--max-output", "6", "--baseline", "hf", "--hf-batch-size", "2",
            "--kv-cache-memory", str(8 * 2**20), "--matmul-seconds", "0.05", "--output", str(out), "--no-progress"]
    assert cli_main(["bench", "throughput", *argv]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(out.read_text())
    assert printed["workload"]["fingerprint"] == saved["workload"]["fingerprint"]
    assert saved["workload"]["num_requests"] == 4
    for system in ("ours", "hf"):
        for key in ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                    "ceiling_output_tokens_per_s", "fraction_of_ceiling"):
            assert saved[system][key] > 0, (system, key)
    assert saved["ours"]["short_requests"] == 0
    # Prefix caching off, as for the baselines: every prompt token is computed.
    assert saved["engine"]["enable_prefix_caching"] is False and saved["ours"]["cached_prompt_tokens"] == 0
    assert set(saved["ours_over_hf"]) == {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s"}
    assert saved["matmul"]["gflops"] > 0
    # The ceiling is timed in the dtype the engine computes in (fp32 for bf16 on a CPU without native bf16).
    expected = compute_dtype(getattr(torch, saved["model"]["dtype"]), torch.device("cpu"))
    assert saved["matmul"]["dtype"] == saved["model"]["compute_dtype"] == str(expected).removeprefix("torch.")
    agreement = saved["greedy_agreement"]
    assert agreement["requests_checked"] == 4
    assert 0.0 <= agreement["identical_token_fraction"] <= 1.0
    assert (tmp_path / "results" / "throughput.png").stat().st_size > 1000


def test_send_poisson_sends_at_the_seeded_arrivals_and_returns_the_answers_in_order():
    gaps, t = [], 0.0
    rng = random.Random(7)
    while (t := t + rng.expovariate(50.0)) < 0.4:
        gaps.append(t)
    sent: list[float] = []
    start = time.perf_counter()

    async def send() -> int:
        sent.append(time.perf_counter() - start)
        index = len(sent)
        await asyncio.sleep(0.05 / index)  # later ones answer sooner: the answers still come in sending order
        return index

    answers = asyncio.run(send_poisson(50.0, 0.4, random.Random(7), send))
    assert answers == list(range(1, len(gaps) + 1))  # every arrival before the end, none after, in order
    assert all(got >= want - 1e-3 for got, want in zip(sent, gaps, strict=True))  # never early


def test_phases_alternate_alone_and_loaded_and_their_p90s_compare():
    from kvrelay.bench.workload import alone_then_loaded, p90_ratio

    calls = []

    def measure(loaded: bool, r: int) -> dict:
        calls.append((loaded, r))
        return {"ttft": {"p90": (3.0 if loaded else 1.0) * (r + 1)}}

    phases = alone_then_loaded(2, "flood", measure)
    assert calls == [(False, 0), (True, 0), (False, 1), (True, 1)]
    assert [(p["round"], p["phase"]) for p in phases] == [(1, "alone"), (1, "flood"), (2, "alone"), (2, "flood")]
    assert p90_ratio(phases, "ttft", "flood") == 3.0 and p90_ratio(phases[:1], "ttft", "flood") is None
