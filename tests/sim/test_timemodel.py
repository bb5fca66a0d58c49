"""Step shapes, the step and transfer models, profiles and the calibration fit."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvrelay.sim.calibrate import Point, fit_best, fit_linear
from kvrelay.sim.gpus import H100, H200, SHIPPED, roofline_profile
from kvrelay.sim.timemodel import PROFILES_DIR, SERVED_ROWS, LinearStep, Profile, StepShape, load_profile
from tests.sim.helpers import tiny_profile


def test_step_shape_counts():
    s = StepShape.of([(1, 99), (1, 9), (64, 128), (16, 0)])
    assert (s.tokens, s.rows, s.prefill_tokens, s.decode_context) == (82, 4, 80, 110)
    assert s.prefill_pairs == 64 * (128 + 65 / 2) + 16 * (17 / 2)
    assert s.prefill_context == 192 + 16


def test_linear_step():
    m = LinearStep(0.01, 0.001, 0.002, 1e-6, 1e-5)
    assert m.time(StepShape.of([(1, 99)])) == pytest.approx(0.01 + 0.001 + 0.002 + 1e-5 * 100)


def test_roofline_is_memory_bound_for_decode_and_compute_bound_for_prefill():
    p = roofline_profile("h100", H100)
    m, model = p.step_model(), p.model
    one = m.time(StepShape.of([(1, 1000)]))
    weights_s = model.weight_bytes / (2 * H100.hbm_bytes_per_s * 0.75)
    assert weights_s < one < weights_s + 0.006  # a lone decode reads the weights once (+ overhead, all-reduces)
    big = m.time(StepShape.of([(8192, 0)]))
    flops_s = 2 * (model.params - model.vocab_size * model.hidden_size) * 8192 / (2 * H100.peak_bf16_flops * 0.55)
    assert flops_s < big < 1.4 * flops_s
    # H200: the same FLOP/s, more bandwidth and memory: faster decodes, equal prefills, a bigger KV cache.
    h200 = roofline_profile("h200", H200)
    assert h200.step_model().time(StepShape.of([(1, 1000)] * 32)) < m.time(StepShape.of([(1, 1000)] * 32))
    assert h200.kv_cache_blocks > 2 * p.kv_cache_blocks


def test_shipped_gpu_profiles_are_the_roofline_of_their_stated_assumptions():
    for name, gpu in SHIPPED.items():
        shipped = json.loads((PROFILES_DIR / f"{name}.json").read_text())
        assert shipped == json.loads(json.dumps(roofline_profile(name, gpu).to_json()))
        assert load_profile(name).step_model().time(StepShape.of([(1, 100)])) > 0


def test_what_serving_adds_is_apart_from_the_fitted_engine_step():
    engine = LinearStep(0.01, 0.001, 0.0005, 0.0, 0.0)
    served = dataclasses.replace(engine, served_step_s=0.004, served_row_s=0.0002, request_overhead_s=0.007)
    shape = StepShape.of([(1, 100)] * 3 + [(20, 0)])  # 23 tokens, 4 rows
    assert engine.time(shape) == pytest.approx(0.01 + 0.023 + 0.002)
    assert served.time(shape) == pytest.approx(engine.time(shape) + 0.004 + 4 * 0.0002)
    wide = StepShape.of([(1, 100)] * 12)  # the row term was measured up to SERVED_ROWS rows, not extrapolated
    assert served.time(wide) == pytest.approx(engine.time(wide) + 0.004 + SERVED_ROWS * 0.0002)
    assert served.engine_only() == engine


def test_profile_json_round_trip(tmp_path):
    p = tiny_profile()
    p.steps[1] = dataclasses.replace(p.steps[1], served_step_s=0.003, served_row_s=0.0001, request_overhead_s=0.007)
    path = p.save(tmp_path / "p.json")
    assert Profile.from_json(json.loads(path.read_text())) == p
    assert load_profile(str(path)) == p
    with pytest.raises(ValueError, match="no step model for 3 threads"):
        Profile.from_json({**p.to_json(), "steps": {"1": p.to_json()["steps"]["1"],
                                                    "2": p.to_json()["steps"]["1"]}}).step_model(3)


def test_each_tile_of_rows_passes_over_the_weights_once():
    m = LinearStep(0.01, 0.001, 0.0, 0.0, 0.0, per_tile_pass_s=0.005, tile_rows=6)
    assert m.time(StepShape.of([(1, 99)] * 6)) == pytest.approx(0.01 + 6 * 0.001 + 0.005)
    assert m.time(StepShape.of([(1, 99)] * 7)) == pytest.approx(0.01 + 7 * 0.001 + 2 * 0.005)
    assert m.time(StepShape.of([(1, 99)] * 3 + [(10, 0)])) == pytest.approx(0.01 + 13 * 0.001 + 3 * 0.005)
    assert dataclasses.replace(m, tile_rows=0).time(StepShape.of([(1, 99)] * 7)) == pytest.approx(0.01 + 0.007)


def test_fit_recovers_a_linear_model_and_keeps_coefficients_non_negative():
    truth = LinearStep(0.004, 2e-4, 5e-4, 3e-8, 2e-6)
    shapes = [StepShape.of([(n, c)]) for n in (16, 64, 256, 1024) for c in (0, 1024)] + \
             [StepShape.of([(1, c)] * r) for r in (1, 8, 32) for c in (256, 1536)] + \
             [StepShape.of([(1, 256)] * r) for r in (2, 4, 6, 12, 16)]
    model, fit = fit_linear([Point(1, "x", s, truth.time(s)) for s in shapes])
    for a, b in zip(vars(model).values(), vars(truth).values()):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-12)
    assert fit["mape"] < 1e-6
    # The tile height that fits best is kept, with its pass cost.
    tiled = dataclasses.replace(truth, per_tile_pass_s=3e-3, tile_rows=6)
    model, fit = fit_best([Point(1, "x", s, tiled.time(s)) for s in shapes])
    assert model.tile_rows == 6 == fit["tile_rows"] and fit["mape"] < 1e-6
    assert model.per_tile_pass_s == pytest.approx(3e-3, rel=1e-6)
    # A term the data says is negative is dropped, not kept below zero.
    skewed = [Point(1, "x", s, max(1e-4, truth.time(s) - 5e-4 * s.rows)) for s in shapes]
    model, _ = fit_linear(skewed)
    assert min(vars(model).values()) >= 0


def test_transfer_time_overlaps_the_step():
    from kvrelay.sim.fleet import Fleet, FleetSpec

    fleet = Fleet(FleetSpec(prefill=1, decode=1), tiny_profile())
    wire = 10 * 4096 / 1e9  # 10 blocks of 4 KiB at 1 GB/s, 2 layers
    assert fleet.transfer_s(10, step_s=1.0) == pytest.approx(0.001 + wire / 2)  # all but the last layer hidden
    assert fleet.transfer_s(10, step_s=0.0) == pytest.approx(0.001 + wire)  # nothing to hide behind
