"""`kvrelay bench decode-attention`: both paths run on the same inputs and agree."""

from __future__ import annotations

import argparse

import pytest

from shared.bench import decode_attention
from shared.engine import kernels as cpu_kernels

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
