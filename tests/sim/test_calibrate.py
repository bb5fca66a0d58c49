"""Calibration times real engine steps of the shapes it asks for (a tiny model: a smoke run), and writes a
profile the simulator loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import pytest

from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvrelay.engine.core import EngineCore
from kvrelay.sim import calibrate, calibrate_served
from kvrelay.sim.calibrate_served import ROWS, measure_served, served_fleet
from kvrelay.sim.timemodel import LinearStep, StepShape, load_profile
from tests.helpers.models import make_tiny_checkpoint, make_tiny_with_tokenizer
from tests.sim.helpers import tiny_profile


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("m") / "m")


def test_each_timed_step_has_the_shape_asked_for(tiny_model):
    core = EngineCore(EngineConfig(model=ModelConfig(model=str(tiny_model), dtype="float32", device="cpu"),
                                   cache=CacheConfig(num_gpu_blocks_override=64)))
    grid = [("prefill", 16, 0), ("prefill", 32, 64), ("decode", 3, 48), ("mixed", 2, 64), ("prefill", 64, 4096)]
    points = calibrate.measure(core, 1, grid, repeats=1)
    assert [p.kind for p in points] == ["prefill", "prefill", "decode", "mixed"]  # 4,096 does not fit: skipped
    assert points[0].shape == StepShape.of([(16, 0)]) and points[1].shape == StepShape.of([(32, 64)])
    assert points[2].shape == StepShape.of([(1, 49)] * 3)  # the second decode step of prompts of 48
    assert points[3].shape == StepShape.of([(1, 65)] * 2 + [(32, 0)])
    assert all(p.seconds > 0 for p in points)


def test_calibrate_writes_a_profile_the_simulator_loads(tiny_model, tmp_path, capsys):
    p = argparse.ArgumentParser()
    calibrate.add_arguments(p)
    out = tmp_path / "local.json"
    calibrate.run(p.parse_args(["--model", str(tiny_model), "--dtype", "float32", "--threads", "1", "--quick",
                                "--repeats", "1", "--skip-transfer", "--skip-served", "--kv-cache-memory", "8MiB",
                                "--out", str(out)]))
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    profile = load_profile(str(out))
    assert summary["profile"] == str(out) and profile.source == "calibrated" and set(profile.steps) == {1}
    assert profile.model.num_layers == 3 and profile.kv_cache_blocks > 0 and profile.machine["cpu_model"]
    assert profile.fit["1"]["points"] >= 3 and "same-host KV transfer" in profile.figures["modelled"]
    assert profile.step_model(1).time(StepShape.of([(1, 100)])) > 0


def test_served_placements_give_each_node_the_thread_count():
    assert served_fleet(2, 2) == (["--colocated"], {"colocated": 1})
    assert served_fleet(1, 2) == (["--prefill", "1", "--decode", "1"], {"prefill": 1, "decode": 1})
    assert served_fleet(1, 4) is None and served_fleet(4, 4)[1] == {"colocated": 1}


def test_what_serving_adds_is_measured_against_the_simulated_engine(tmp_path, default_model_dir, monkeypatch):
    # A colocated fleet of the tiny model on every core, its engine steps modelled as free: what serving adds is
    # then the whole served gap between tokens and time to first token, which real HTTP streams, RPCs and steps
    # cannot make zero. The profile's own served terms are left out of the simulated side.
    for name, value in (("LONE", 4), ("ROUNDS", 1), ("OUTPUT", 12)):  # fewer, shorter streams than a calibration
        monkeypatch.setattr(calibrate_served, name, value)
    cores = len(os.sched_getaffinity(0))
    profile = tiny_profile()
    model = make_tiny_with_tokenizer(tmp_path / "m", Path(default_model_dir))  # a gateway needs its tokenizer
    free = dataclasses.replace(profile, model=dataclasses.replace(profile.model, vocab_size=49152),
                               steps={cores: LinearStep(0.0, 0.0, 0.0, 0.0, 0.0, served_step_s=9.0,
                                                        request_overhead_s=9.0)})
    served = measure_served(free, cores, tmp_path, ["--model", str(model), "--dtype", "float32",
                                                    "--kv-cache-memory", "8MiB"])
    # Free engine steps: the terms give back the real gaps, a lone stream's and ROWS streams' (neither below 0).
    assert 0.0 < served.served_step_s + served.served_row_s < 1.0
    assert served.served_row_s >= 0.0 and served.served_step_s + (ROWS - 1) * served.served_row_s < 1.0
    # The lone requests' time to first token less one served step: at least 0 (on a machine that other work
    # loads, the gaps that gave the step terms can come out as long as the first token's wait).
    assert 0.0 <= served.request_overhead_s < 1.0
    step = served.applied(free.steps[cores])
    assert (step.served_step_s, step.request_overhead_s) == (round(served.served_step_s, 6),
                                                             round(served.request_overhead_s, 6))
    assert step.time(StepShape.of([(1, 10)])) == step.served_step_s + step.served_row_s
