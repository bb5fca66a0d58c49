"""`kvrelay bench throughput` refuses a comparison it cannot make before it loads anything; the single-stream
measurements it sets beside llama.cpp's llama-bench."""

import subprocess
import sys

import pytest


def test_vllm_baseline_refused_off_cpu():
    # vLLM's baseline is its CPU build; on a CUDA device it would compare a GPU engine against a CPU one.
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "throughput", "--device", "cuda",
                           "--baseline", "vllm", "--no-progress"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "the vLLM baseline is vLLM's CPU build; on cuda compare with --baseline hf" in done.stderr
    assert "engine ready" not in done.stderr  # refused before the engine was built


def test_llamacpp_baseline_needs_a_gguf():
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "throughput", "--model", "/tmp",
                           "--baseline", "llamacpp", "--no-progress"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "llama.cpp runs GGUF files" in done.stderr
    assert "engine ready" not in done.stderr


def test_kv_auto_baseline_needs_a_quantized_cache():
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "throughput", "--baseline", "kv-auto",
                           "--no-progress"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "give --kv-cache-dtype fp8 or int8" in done.stderr
    assert "engine ready" not in done.stderr


def test_single_stream_measurements_of_ours(tmp_path):
    from kvrelay.bench.llamacpp_baseline import run_ours_single_stream
    from kvrelay.engine.config import engine_config_from_kwargs
    from kvrelay.engine.core import EngineCore
    from tests.helpers.models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    engine = EngineCore(engine_config_from_kwargs(str(path), "float32", kv_cache_memory=4 << 20,
                                                  enable_prefix_caching=False))
    out = run_ours_single_stream(engine, 500, n_prompt=64, n_gen=8, reps=2)
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0
    assert out["time_per_output_token_ms"] == pytest.approx(1000 / out["decode_tokens_per_s"])
    assert not engine.has_unfinished()
