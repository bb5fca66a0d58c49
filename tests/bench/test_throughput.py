"""`kvrelay bench throughput` refuses a comparison it cannot make before it loads anything."""

import subprocess
import sys


def test_vllm_baseline_refused_off_cpu():
    # vLLM's baseline is its CPU build; on a CUDA device it would compare a GPU engine against a CPU one.
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "bench", "throughput", "--device", "cuda",
                           "--baseline", "vllm", "--no-progress"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "the vLLM baseline is vLLM's CPU build; on cuda compare with --baseline hf" in done.stderr
    assert "engine ready" not in done.stderr  # refused before the engine was built
