# Bench-only: make torch report an AVX2-only CPU (no AVX512, AVX512-BF16, AMX) so vLLM loads its AVX2
# kernels and picks its AVX2 attention path. oneDNN and ATen are bounded by ONEDNN_MAX_CPU_ISA /
# ATEN_CPU_CAPABILITY set alongside (env.sh).
import importlib.util
import os

if os.environ.get("EMU_AVX2") == "1" and importlib.util.find_spec("torch") is not None:
    import torch.cpu

    for check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        setattr(torch.cpu, check, lambda: False)
