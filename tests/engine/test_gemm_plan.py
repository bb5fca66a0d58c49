"""The measured GEMM plan for bf16 linear layers on AMX: its row buckets, its verdicts kept on disk and read back
by the next process, and linear() running the kernel the plan names for each row count."""

import json

import pytest
import torch

from kvrelay.engine import kernels as cpu_kernels
from kvrelay.engine.models import cpu_linear, gemm_plan

native = cpu_kernels.load()


def test_row_buckets_start_above_the_fixed_limit():
    plan = gemm_plan.RowPlan(first=128, small=(True, False, True))
    assert [plan.takes_small(r) for r in (1, 128)] == [False, False]  # below: the caller's fixed limit decides
    assert [plan.takes_small(r) for r in (129, 192)] == [True, True]
    assert [plan.takes_small(r) for r in (193, 256)] == [False, False]
    assert [plan.takes_small(r) for r in (257, 320)] == [True, True]
    assert plan.takes_small(321) is False  # past the measured range: oneDNN


def test_onednn_takes_a_bucket_only_when_clearly_faster():
    assert gemm_plan.small_wins(1.0, 1.0) and gemm_plan.small_wins(1.0, 1.2)
    assert gemm_plan.small_wins(1.0, gemm_plan.ODNN_MARGIN)  # within the margin: still the small GEMM
    assert not gemm_plan.small_wins(1.0, 0.9 * gemm_plan.ODNN_MARGIN)


amx = pytest.mark.skipif(native is None or not native.amx_tiles(), reason="the plan is measured on AMX CPUs only")


@amx
def test_verdicts_are_cached_on_disk_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    gemm_plan.plan.cache_clear()
    measured = gemm_plan.plan(48, 64, 1984, native)  # one bucket only (1984, 2048]: quick
    assert measured.first == 1984 and len(measured.small) == 1
    path = tmp_path / gemm_plan.CACHE_FILE
    cache = json.loads(path.read_text())
    (key,) = cache
    assert "bf16 48x64 above 1984" in key and cache[key] == list(measured.small)
    # Another process (a cleared in-process cache) reads the file instead of measuring again.
    cache[key] = [not measured.small[0]]
    path.write_text(json.dumps(cache))
    gemm_plan.plan.cache_clear()
    assert gemm_plan.plan(48, 64, 1984, native).small == (not measured.small[0],)
    gemm_plan.plan.cache_clear()


@amx
def test_linear_runs_the_kernel_the_plan_names():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    base = cpu_linear.pack(w)
    first = base.small_rows
    packed = cpu_linear.PackedWeight(base.onednn, base.small, 96, first,
                                     gemm_plan.RowPlan(first, (True, False)))
    for rows, small in ((first, True), (first + 1, True), (first + 64, True), (first + 65, False),
                        (first + 129, False)):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        want = (native.small_gemm(x, base.small, 96, None) if small
                else torch.ops.mkldnn._linear_pointwise(x, base.onednn, None, "none", [], ""))
        assert torch.equal(cpu_linear.linear(x, w, None, packed), want), rows
