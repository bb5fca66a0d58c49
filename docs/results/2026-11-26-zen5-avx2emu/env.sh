# Hold torch, oneDNN, our kernels and vLLM to AVX2 on an AVX512 machine (NOTES.md beside this
# file). `source` it before the benchmark commands; sitecustomize.py must sit in this folder.
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" EMU_AVX2=1
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 KVRELAY_KERNEL_MARCH=x86-64-v3
