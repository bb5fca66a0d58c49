"""`kvrelay bench structured`: a small run reports every variant with sane numbers."""

from __future__ import annotations

import argparse
import json

from kvrelay.bench import structured


def test_small_run_reports_step_cost_and_ttft(tmp_path):
    p = argparse.ArgumentParser()
    structured.add_arguments(p)
    out = tmp_path / "r.json"
    args = p.parse_args(["--batch", "2", "--steps", "3", "--rounds", "1", "--repetitions", "1", "--dtype", "float32",
                         "--output", str(out)])
    assert structured.run(args) == 0
    r = json.loads(out.read_text())
    for part in ("sampler", "engine"):
        costs = r["step_cost"][part]
        assert set(costs) == {"0_of_2_constrained", "1_of_2_constrained", "2_of_2_constrained"}
        assert costs["0_of_2_constrained"]["ratio_vs_unconstrained"] == 1.0
        assert all(v["ms"] > 0 for v in costs.values())
    assert r["row_pieces"]["bitmask_fill_us"] > 0 and r["row_pieces"]["bitmask_apply_us"] > 0
    assert all(len(v) == 1 and v[0] > 0 for v in r["ttft"]["samples_ms"].values())
    assert r["backend"] == "xgrammar" and r["vocab_size"] == 49152
