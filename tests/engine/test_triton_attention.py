"""The triton attention backend (paged attention read in place, and the K/V write) against the dense reference of
test_attention: on a GPU natively, else in Triton's interpreter on the CPU where triton is installed (CI's CPU
machines have no triton: these tests skip there)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (CUDA builds of torch ship it)", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the import below
    from triton.runtime import interpreter

    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _index_of_one_element(tensor, scope) -> None:
        # The interpreter holds a scalar as a 1-element array, and int() of one is an error since numpy 2.4:
        # a loop bounded by a loaded value would not run there (compiled kernels are unaffected).
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _index_of_one_element

from kvrelay.engine.attention import TorchAttentionBackend  # noqa: E402
from kvrelay.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

from .test_attention import BATCH, HEAD_SIZE, LONG_BATCH, NUM_HEADS, NUM_KV_HEADS, SCALE, Case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu if DEVICE == "cuda" else []


@pytest.mark.parametrize("window", [None, 8, 37], ids=["full", "window8", "window37"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_batch_matches_dense_reference(block_size, window):
    case = Case(LONG_BATCH, block_size, torch.float32, device=DEVICE)
    q, k, v, meta = case.inputs()
    out = TritonAttentionBackend().forward(q, k, v, case.cache, meta, SCALE, sliding_window=window)
    assert out.shape == q.shape
    assert (out.cpu() - case.reference(window)).abs().max().item() < 1e-4


def test_writes_the_new_kv_where_the_torch_backend_does():
    case = Case(BATCH, 16, torch.float32, device=DEVICE)
    q, k, v, meta = case.inputs()
    ours = case.cache.clone()
    TritonAttentionBackend().forward(q, k, v, ours, meta, SCALE)
    TorchAttentionBackend(use_native=False).forward(q, k, v, case.cache, meta, SCALE)
    assert torch.equal(ours, case.cache)


def test_queries_as_a_strided_view_of_the_qkv_rows():
    # The model passes q and k as views into one qkv tensor: rows are strided, heads contiguous.
    case = Case(BATCH, 16, torch.float32, device=DEVICE)
    q, k, v, meta = case.inputs()
    qkv = torch.cat([q, k, v], dim=1)
    out = TritonAttentionBackend().forward(qkv[:, :NUM_HEADS], qkv[:, NUM_HEADS:NUM_HEADS + NUM_KV_HEADS],
                                           qkv[:, NUM_HEADS + NUM_KV_HEADS:], case.cache, meta, SCALE)
    assert (out.cpu() - case.reference()).abs().max().item() < 1e-4


@pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter gets bf16 dot products wrong (numpy has no bf16)")
def test_bf16_within_rounding():
    case = Case(LONG_BATCH, 16, torch.bfloat16, device=DEVICE)
    q, k, v, meta = case.inputs()
    out = TritonAttentionBackend().forward(q, k, v, case.cache, meta, SCALE)
    assert out.dtype == torch.bfloat16
    assert (out.float().cpu() - case.reference()).abs().max().item() < 3e-2


def test_padded_decode_rows_write_nothing():
    # A CUDA graph's batch is padded to its captured size: padded rows carry slot -1 and a one-token context.
    decodes = [(c, n) for c, n in BATCH if n == 1]
    case = Case(decodes, 16, torch.float32, device=DEVICE)
    q, k, v, meta = case.inputs()
    pad = 3
    before = case.cache.clone()
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    meta.seq_lens = torch.cat([meta.seq_lens, torch.ones(pad, dtype=torch.int32, device=DEVICE)])
    meta.query_start_loc = torch.arange(len(decodes) + pad + 1, dtype=torch.int32, device=DEVICE)
    meta.block_tables = torch.cat([meta.block_tables, meta.block_tables[:1].expand(pad, -1)])
    meta.num_reqs = meta.num_decodes = meta.num_decode_tokens = len(decodes) + pad
    grow = lambda t: torch.cat([t, torch.randn(pad, *t.shape[1:], device=DEVICE)])  # noqa: E731
    out = TritonAttentionBackend().forward(grow(q), grow(k), grow(v), case.cache, meta, SCALE)
    assert torch.isfinite(out).all()
    assert (out[: len(decodes)].cpu() - case.reference()).abs().max().item() < 1e-4
    written = before.view(2, -1, NUM_KV_HEADS, HEAD_SIZE).clone()
    slots = meta.slot_mapping[: len(decodes)]
    written[0][slots], written[1][slots] = k, v
    assert torch.equal(case.cache.view_as(written), written)  # only the real rows' slots changed


def test_a_narrow_cache_goes_through_the_torch_backend():
    case = Case(BATCH, 16, torch.float32, device=DEVICE)
    q, k, v, meta = case.inputs()
    cache = case.cache.to(torch.bfloat16)
    backend = TritonAttentionBackend()
    assert not backend.graph_safe(torch.float32, torch.bfloat16)
    out = backend.forward(q, k, v, cache, meta, SCALE)
    assert (out.cpu() - case.reference()).abs().max().item() < 3e-2


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvrelay.engine.attention import triton_kernels as tk

target = GPUTarget("cuda", 90, 32)  # Hopper: the H100 and H200
for dt, ieee in (("bf16", False), ("fp16", False), ("fp32", True)):
    for block_q in (4, 16):  # a decode's tile (GQA group of 4), a chunk's
        sig = {"q_ptr": f"*{dt}", "out_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "tables_ptr": "*i32",
               "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32",
               "stride_oh": "i32", "stride_table": "i32", "value_offset": "i64", "num_kv_heads": "i32",
               "scale": "fp32", "window": "i32"}
        consts = {"GROUP": 4, "GROUP_PAD": 4, "BLOCK_Q": block_q, "HEAD": 64, "HEAD_PAD": 64, "BLOCK_SIZE": 16,
                  "BLOCK_N": 64, "IEEE": ieee}
        sig.update({name: "constexpr" for name in consts})
        triton.compile(ASTSource(fn=tk._paged_attention_kernel, signature=sig, constexprs=consts), target=target,
                       options={"num_warps": 4, "num_stages": 2})
    sig = {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "slot_ptr": "*i64", "stride_kt": "i32",
           "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32", "value_offset": "i64", "num_kv_heads": "i32",
           "HEAD": "constexpr", "HEAD_PAD": "constexpr"}
    triton.compile(ASTSource(fn=tk._write_kv_kernel, signature=sig, constexprs={"HEAD": 64, "HEAD_PAD": 64}),
                   target=target)
print("compiled")
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the other tests compile and run them")
def test_the_kernels_compile_for_hopper_without_a_gpu():
    # The interpreter runs the kernels' logic but checks nothing a compiler would (types, tl.dot's shapes): the
    # kernels are compiled here for sm_90 with the ptxas that triton's wheel carries, in a process of their own
    # (this one interprets them).
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
