"""The llama.cpp baseline (`kvrelay bench throughput --baseline llamacpp`): llama.cpp's own `llama-bench` on the
GGUF our engine serves, beside the same two single-stream measurements of ours, in the same invocation.

- prefill: tokens per second computing a prompt of `n_prompt` random tokens (llama-bench's pp512);
- decode: tokens per second generating `n_gen` tokens one at a time (llama-bench's tg128; ours after a one-token
  prompt, greedy, ignore_eos), i.e. 1000 / time per output token in ms.

Each is the median of `reps` runs, fresh random tokens each time (no prefix cache hit), after a warm-up; llama-bench
gets the threads our engine uses. llama-bench comes from a native build of llama.cpp's sources (those vendored in
`llama-cpp-python`'s sdist on PyPI: `cmake -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF` and the targets llama-bench
and llama-perplexity, about 10 minutes on two cores). `find_tool` finds each of its programs (here and for
`kvrelay bench accuracy`): a path given on the command line, else $KVRELAY_LLAMACPP_BIN/<program>, else the peer
kit's build.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
from pathlib import Path

from kvrelay.bench.offline import run_closed_loop

PEER_KIT_BIN = "/tmp/peerkit/llamacpp/bin"  # where the peer kit's build of llama.cpp puts its programs


def find_tool(name: str, explicit: str | None) -> str | None:
    """llama.cpp's program `name` (llama-bench, llama-perplexity, llama-server): `explicit` ("none": go without),
    else $KVRELAY_LLAMACPP_BIN/<name>, else the peer kit's; None when none of them is a file."""
    if explicit == "none":
        return None
    folders = (os.environ.get("KVRELAY_LLAMACPP_BIN"), PEER_KIT_BIN)
    for candidate in (explicit, *(os.path.join(f, name) for f in folders if f)):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def gguf_file(model: str) -> str:
    """The GGUF llama.cpp runs for `--model` (a .gguf file, or 'default'); ValueError for a folder."""
    from kvrelay.model_files.resolve import default_gguf_path

    if model == "default":
        return str(default_gguf_path())
    if not model.lower().endswith(".gguf"):
        raise ValueError(f"llama.cpp runs GGUF files; give --model a .gguf file or 'default', not {model!r}")
    return model


def gguf_and_tool(model: str, name: str, explicit: str | None, asker: str) -> tuple[str, str]:
    """The GGUF `--model` names and llama.cpp's program `name` (as find_tool finds it), checked before anything
    loads: SystemExit saying what `asker` (the command line asking) is missing."""
    try:
        gguf = gguf_file(model)
    except ValueError as e:
        raise SystemExit(f"{asker}: {e}") from None
    tool = find_tool(name, explicit)
    if tool is None:
        raise SystemExit(f"{asker}: no {name} (give --{name}, set $KVRELAY_LLAMACPP_BIN, or build the peer kit's: "
                         "LLAMACPP=1 bash setup.sh)")
    return gguf, tool


def run_llama_bench(binary: str, gguf: str, threads: int, n_prompt: int = 512, n_gen: int = 128,
                    reps: int = 3, timeout_s: float = 1800.0) -> dict:
    """llama-bench's prefill and decode tokens per second on `gguf` (RuntimeError when it fails)."""
    argv = [binary, "-m", gguf, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps),
            "-o", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-2000:]}")
    rows = json.loads(done.stdout)
    out = {"binary": binary, "threads": threads, "build": rows[0].get("build_commit") if rows else None}
    for row in rows:
        key = "decode" if row.get("n_gen") else "prefill"
        out[f"{key}_tokens_per_s"] = row["avg_ts"]
        out[f"{key}_tokens_per_s_stdev"] = row.get("stddev_ts")
    out["time_per_output_token_ms"] = 1000.0 / out["decode_tokens_per_s"]
    return out


def run_ours_single_stream(engine, vocab_size: int, n_prompt: int = 512, n_gen: int = 128, reps: int = 3,
                           seed: int = 0) -> dict:
    """Our engine on llama-bench's two measurements (see the module's doc)."""
    from kvrelay.common.sampling_params import SamplingParams

    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    first_only = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run_closed_loop(engine, [(tokens(16), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    prefill = []
    for _ in range(reps):
        elapsed, _ = run_closed_loop(engine, [(tokens(n_prompt), first_only)])
        prefill.append(n_prompt / elapsed)
    decode = []
    for _ in range(reps):
        _, (timing,) = run_closed_loop(engine, [(tokens(1), SamplingParams(temperature=0.0, max_tokens=n_gen + 1,
                                                                           ignore_eos=True))])
        decode.append(n_gen / (timing.last - timing.first))  # the n_gen tokens after the first
    out = {"prefill_tokens_per_s": statistics.median(prefill), "decode_tokens_per_s": statistics.median(decode)}
    out["time_per_output_token_ms"] = 1000.0 / out["decode_tokens_per_s"]
    return out
