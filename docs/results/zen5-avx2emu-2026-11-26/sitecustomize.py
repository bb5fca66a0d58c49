# Bench-only: make torch report an AVX2-only CPU (no AVX512, AVX512-BF16, AMX) so vLLM loads its AVX2
# kernels and picks its AVX2 attention path. oneDNN and ATen are bounded by ONEDNN_MAX_CPU_ISA /
# ATEN_CPU_CAPABILITY set alongside.
import os
if os.environ.get("EMU_AVX2") == "1":
    try:
        import torch.cpu as _c
    except ImportError:
        _c = None
    if _c is not None:
        _c._is_avx512_supported = lambda: False
        _c._is_avx512_bf16_supported = lambda: False
        _c._is_avx512_vnni_supported = lambda: False
        _c._is_amx_tile_supported = lambda: False
        _c._is_amx_fp16_supported = lambda: False
