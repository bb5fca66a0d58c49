"""`kvrelay bench ttft`: what its summary makes of paired colocated and disaggregated requests."""

from __future__ import annotations

import pytest

from kvrelay.bench import ttft


def test_added_beyond_compute_is_the_paired_difference_against_the_last_layer_target():
    colocated = [{"ttft_s": t, "compute_s": t - 0.010} for t in (1.00, 1.20, 1.10)]
    disaggregated = [{"ttft_s": c["ttft_s"] + 0.30, "compute_s": c["compute_s"] + 0.29 - 0.004 * i,
                      "reserve_s": 0.003, "last_layer_s": 0.002, "transfer_s": 0.05, "bytes": 1000}
                     for i, c in enumerate(colocated)]
    s = ttft.summarize("shm", 512, {"colocated": colocated, "disaggregated": disaggregated})
    # added per pair = (0.30 - 0.29 + 0.004 i) - 0: 0.010, 0.014, 0.018; the target is 2 ms + 5 ms
    assert s["added_by_disaggregation_s"] == pytest.approx(0.014)
    low, high = s["added_by_disaggregation_ci95_s"]
    assert 0.010 - 1e-9 <= low <= 0.014 <= high <= 0.018 + 1e-9
    assert s["target_s"] == pytest.approx(0.007) and s["target_margin_s"] == pytest.approx(-0.007)
    assert not s["meets_target"] and not s["raw_meets_target"]
    assert s["ttft_difference_s"] == pytest.approx(0.30) and s["colocated_ttft_s"] == pytest.approx(1.10)
    assert s["prefill_compute_slowdown"] == pytest.approx(1.372 / 1.09 - 1)  # medians of compute: 1.372 vs 1.09
    assert (s["transport"], s["prompt_tokens"], s["kv_bytes"], s["reserve_rpc_s"]) == ("shm", 512, 1000, 0.003)
