"""`kvrelay bench decode-attention`: both paths run on the same inputs and agree."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvrelay.bench import decode_attention
from kvrelay.engine import kernels as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler for the native kernel")


def test_small_run_reports_both_paths_and_they_agree(tmp_path):
    p = argparse.ArgumentParser()
    decode_attention.add_arguments(p)
    out = tmp_path / "r.json"
    args = p.parse_args(["--decodes", "3", "--context", "37", "--num-blocks", "20", "--seconds", "0.01",
                         "--output", str(out)])
    assert decode_attention.run(args) == 0
    r = decode_attention.measure(args)
    assert r["shape"]["num_blocks"] == 20 and r["max_abs_diff"] < 1e-5
    assert r["native"]["ms_per_layer"] > 0 and r["portable"]["ms_per_layer"] > 0
    assert r["native_speedup"] == pytest.approx(r["portable"]["ms_per_layer"] / r["native"]["ms_per_layer"])
    assert out.read_text().startswith("{")


def test_bf16_run_agrees_within_bf16_rounding():
    p = argparse.ArgumentParser()
    decode_attention.add_arguments(p)
    args = p.parse_args(["--decodes", "5", "--context", "70", "--num-blocks", "40", "--seconds", "0.01",
                         "--dtype", "bfloat16"])
    r = decode_attention.measure(args)
    assert r["shape"]["dtype"] == "bfloat16" and r["kv_prefetch"] in ("l1", "l2")
    # Both paths round their output to bf16 (and the native one its weights for p . v): a few units in the last
    # place of outputs whose magnitude stays below the largest value, ~4 for these normal draws.
    assert r["max_abs_diff"] < 8 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_a_quantized_cache_is_set_beside_the_same_values_in_a_cache_of_the_dtype(kv):
    p = argparse.ArgumentParser()
    decode_attention.add_arguments(p)
    args = p.parse_args(["--decodes", "4", "--context", "50", "--num-blocks", "30", "--seconds", "0.01",
                         "--kv-cache-dtype", kv])
    r = decode_attention.measure(args)
    assert r["kv_cache_dtype"] == kv and r["max_abs_diff"] < 1e-4
    plain = r["native_over_a_cache_of_dtype"]["ms_per_layer"]
    assert r["quantized_speedup"] == pytest.approx(plain / r["native"]["ms_per_layer"])
