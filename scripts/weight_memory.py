"""Resident memory a model's weights take, against the size of the file they came from.

Loads the model twice in one process and counts what the second load adds to the process's resident set
(/proc/self/smaps_rollup, after `gc` and `malloc_trim`): the first load pays every import and one-time setup
(libraries paged in, caches), so the second counts the weights alone, as an operator would see them on a node.

    python scripts/weight_memory.py                              # the default GGUF on its blocks, --dtype auto
    python scripts/weight_memory.py --dtype float32 --quantization none   # dequantized at load, for comparison
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
from pathlib import Path

from kvrelay.common.system import release_freed_memory


def resident_mib() -> dict[str, int]:
    gc.collect()
    release_freed_memory()
    text = open("/proc/self/smaps_rollup").read()
    return {k: int(re.search(rf"^{k}:\s+(\d+)", text, re.M).group(1)) // 1024 for k in ("Rss", "Anonymous")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="gguf", help="gguf (the file's blocks) or none (dequantized at load)")
    args = p.parse_args()

    from kvrelay.engine.attention import get_attention_backend
    from kvrelay.engine.config import engine_config_from_kwargs
    from kvrelay.engine.model_info import load_model_info
    from kvrelay.engine.models.loader import checkpoint_files, load_model

    quantization = None if args.quantization == "none" else args.quantization
    info = load_model_info(engine_config_from_kwargs(args.model, args.dtype, quantization=quantization).model)
    attn = get_attention_backend("auto", info.device)

    def load():
        return load_model(info.path, info.dtype, info.device, attn, gguf_blocks=info.gguf_path,
                          quantization=info.quantization)

    load()  # every import and one-time setup paid, the model freed
    before = resident_mib()
    model = load()  # held until `after` is read
    after = resident_mib()
    source = info.gguf_path or info.path
    files = [Path(source)] if info.gguf_path else checkpoint_files(Path(source))
    size = sum(os.path.getsize(f) for f in files)
    added = after["Rss"] - before["Rss"]
    print(json.dumps({"model": str(source), "dtype": str(info.dtype).removeprefix("torch."),
                      "quantization": info.quantization, "file_mib": round(size / 2**20, 1),
                      "resident_mib": added, "anonymous_mib": after["Anonymous"] - before["Anonymous"],
                      "resident_over_file": round(added / (size / 2**20), 3)}, indent=1))
    del model


if __name__ == "__main__":
    main()
