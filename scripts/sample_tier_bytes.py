"""Sample the KV offload tiers' folders while a load runs: the most bytes each held, against its bound.

The store's own accounting runs under the tier's lock; this reads the folders from outside, as an operator's `du`
would, every `--interval` seconds until `--stop-file` appears. A listing taken while a writer renames a temporary
file into place may name the same file twice, so files count once per inode. What counts is what the store
counts: blocks (`*.kvb`) and writes in progress (`.tmp.*`).

    python scripts/sample_tier_bytes.py --tier memory=/dev/shm/kvr-t:16MiB --tier disk=/tmp/kvr-d:32MiB \\
        --stop-file /tmp/stop --out tiers.json &
    kvrelay bench soak --duration 600 --up-args "--kv-offload-bytes 16MiB --kv-offload-path /dev/shm/kvr-t ..."
    touch /tmp/stop
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kvrelay.common.units import parse_bytes


def folder_bytes(path: str) -> tuple[int, int]:
    """(bytes, files) of blocks and writes in progress in `path`, each file once."""
    total = files = 0
    seen: set[int] = set()
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if not (entry.name.endswith(".kvb") or entry.name.startswith(".tmp.")):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
                    files += 1
    except FileNotFoundError:
        pass
    return total, files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tier", action="append", required=True, metavar="NAME=DIR:BOUND")
    p.add_argument("--stop-file", required=True)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tiers = {}
    for spec in args.tier:
        name, _, rest = spec.partition("=")
        folder, _, bound = rest.rpartition(":")
        tiers[name] = (folder, parse_bytes(bound))
    peak = dict.fromkeys(tiers, 0)
    most_files = dict.fromkeys(tiers, 0)
    over: list[tuple[float, str, int]] = []
    samples, t0 = 0, time.monotonic()
    while not os.path.exists(args.stop_file):
        for name, (folder, bound) in tiers.items():
            size, files = folder_bytes(folder)
            peak[name] = max(peak[name], size)
            most_files[name] = max(most_files[name], files)
            if size > bound:
                over.append((round(time.monotonic() - t0, 1), name, size))
        samples += 1
        time.sleep(args.interval)
    report = {"seconds": round(time.monotonic() - t0, 1), "samples": samples, "peak_bytes": peak,
              "most_files": most_files, "bounds": {n: b for n, (_, b) in tiers.items()},
              "samples_over_bound": len(over), "first_over_bound": over[:20]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
