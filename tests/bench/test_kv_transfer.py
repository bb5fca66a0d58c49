"""`kvrelay bench kv-transfer`: a tiny real run, in-process (local) and between its two peer processes (shm),
reports every case and pattern with timings of every repeat, and leaves no peer process behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvrelay.bench import parse_args
from kvrelay.bench.kv_transfer import run
from tests.helpers.procs import descendants


@pytest.mark.timeout(180)
def test_a_tiny_run_reports_every_case_and_stops_its_peers(tmp_path, capsys):
    out = tmp_path / "kv.json"
    args = parse_args("kvrelay.bench.kv_transfer", [
        "--connectors", "local,shm", "--layers", "2", "--blocks", "4", "--cache-blocks", "16",
        "--repeats", "2", "--output", str(out),
    ])
    assert run(args) == 0
    report = json.loads(out.read_text())
    assert report["bytes_per_transfer"] == 2 * 2 * 4 * 16 * 3 * 64 * 2  # layers, K+V, blocks, block, heads, bf16
    rows = [(r["case"], r["connector"], r["pattern"], len(r["seconds"])) for r in report["results"]]
    assert rows == [("local", "local", "scattered", 2), ("local", "local", "contiguous", 2),
                    ("shm", "shm", "scattered", 2), ("shm", "shm", "contiguous", 2)]
    assert all(r["gbps_best"] > 0 and r["ratio_to_memcpy"] > 0 for r in report["results"])
    assert json.loads(capsys.readouterr().out) == report
    assert not [pid for pid in descendants(os.getpid()) if _is_peer(pid)]


def _is_peer(pid: int) -> bool:
    try:
        return b"kvrelay.bench.kv_transfer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
