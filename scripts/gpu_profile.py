"""Where a GPU decode step and a GPU serving run spend their time: the tables to read before speeding either up
(scripts/gpu_check.sh's profile phase; it needs no model file).

- decode: torch.profiler over the model runner's decode steps (random Llama-1B-shaped weights, as `kvrelay
  bench decode-step` uses; batch 64, context 1024), with CUDA graphs and eagerly: the device time of each kernel
  and the host time of each op, as text tables.
- serve: cProfile of `kvrelay bench throughput`'s engine run, on random weights of SmolLM2-135M's shape with the
  default model's tokenizer (a folder given by --tokenizer; bf16, 256 requests, no baseline): the host's time by
  function, sorted by own time and by cumulative time.

    python scripts/gpu_profile.py --out DIR --tokenizer DIR [--device cpu --small]   # (cpu: a dry run)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)


def _table(prof, key: str, rows: int = 45) -> str:
    try:
        return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
    except (AttributeError, KeyError, ValueError) as e:  # a torch that names the column otherwise
        return f"(no table sorted by {key}: {e})"


def profile_decode(out: Path, device: str, small: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from kvrelay.bench.decode_step import LLAMA_1B, DecodeDriver, write_random_llama

    batch, context, steps = (4, 64, 4) if small else (64, 1024, 10)
    shape = {**LLAMA_1B, **({"num_hidden_layers": 2, "vocab_size": 4096} if small else {})}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with tempfile.TemporaryDirectory(prefix="kvrelay-profile-") as tmp:
        write_random_llama(Path(tmp), shape, torch.bfloat16, device)
        for eager in (False, True) if device == "cuda" else (True,):
            ns = argparse.Namespace(dtype="bfloat16", device=device)
            driver = DecodeDriver(Path(tmp), ns, eager, batch, context + steps + 8)
            prof = profile(activities=activities)
            runner, execute, calls = driver.runner, driver.runner.execute, [0]

            def profiled(step, execute=execute, prof=prof, calls=calls):
                calls[0] += 1
                if calls[0] == 5:  # after the prefill and 3 warm-up steps
                    prof.start()
                result = execute(step)
                if calls[0] == 4 + steps:
                    prof.stop()
                return result

            runner.execute = profiled
            seconds = driver.time_steps(batch, context, steps)
            name = "eager" if eager else "graphs"
            text = [f"decode {name}: batch {batch}, context {context}, {steps} steps, median step "
                    f"{sorted(seconds)[len(seconds) // 2] * 1e3:.3f} ms",
                    "== by device time (self)", _table(prof, "self_device_time_total"),
                    "== by host time (self)", _table(prof, "self_cpu_time_total")]
            (out / f"profile_decode_{name}.txt").write_text("\n".join(text))
            print(text[0], flush=True)
            del driver, prof
            if device == "cuda":
                torch.cuda.empty_cache()


def profile_serve(out: Path, device: str, small: bool, tokenizer: Path) -> None:
    from kvrelay.bench import parse_args, throughput
    from kvrelay.bench.decode_step import write_random_llama

    shape = {**SMOLLM2, **({"num_hidden_layers": 2} if small else {})}
    with tempfile.TemporaryDirectory(prefix="kvrelay-profile-serve-") as tmp:
        write_random_llama(Path(tmp), shape, torch.bfloat16, device)
        for f in tokenizer.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, tmp)
        n = 16 if small else 256
        flags = ["--model", tmp, "--device", device, "--dtype", "bfloat16", "--num-requests", str(n),
                 "--max-num-seqs", str(n), "--baseline", "none", "--matmul-seconds", "0.2", "--no-plot",
                 "--no-progress", "--output", str(out / "profile_serve_throughput.json")]
        args = parse_args(throughput.__name__, flags + (["--max-input", "128", "--max-output", "16"] if small else []))
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.runcall(throughput.run, args)
        text = [f"serve: {n} requests, bf16, {time.perf_counter() - start:.1f} s in all (load included)"]
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
            text += [f"== by {key}", buf.getvalue()]
        (out / "profile_serve.txt").write_text("\n".join(text))
        print(text[0], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True, help="a folder with the default model's tokenizer files")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (a dry run of the script)")
    p.add_argument("--parts", nargs="+", default=["decode", "serve"], choices=["decode", "serve"])
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if "decode" in a.parts:
        profile_decode(a.out, a.device, a.small)
    if "serve" in a.parts:
        profile_serve(a.out, a.device, a.small, a.tokenizer)


if __name__ == "__main__":
    main()
