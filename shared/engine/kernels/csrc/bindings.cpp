// The Python module of the CPU kernels (one extension, built once per machine by shared/engine/kernels).
#include <torch/extension.h>

#include "api.h"


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL: a node's event loop (gRPC streams) can run its Python meanwhile instead of
  // holding up the engine thread between kernels.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &kvrelay::paged_attention, nogil,
        "attention of a step's decodes and chunks over the paged KV cache, reading it in place");
  m.def("attention_isa", &kvrelay::attention_isa, "the vector unit the attention kernels were built for");
  m.def("add_rms_norm", &kvrelay::add_rms_norm, nogil, "residual += x; rms_norm(residual) * w -> (out, residual)");
  m.def("silu_mul", &kvrelay::silu_mul, nogil, "silu(gate) * up over a fused gate|up row");
  m.def("pack_small_gemm", &kvrelay::pack_small_gemm, nogil, "a weight [N, K] in small_gemm's panels");
  m.def("small_gemm", &kvrelay::small_gemm, nogil, "y = x w^T + b for a decode step's few rows, on a packed weight");
  m.def("small_gemm_silu_mul", &kvrelay::small_gemm_silu_mul, nogil,
        "silu(gate) * up of x times a gate|up weight packed with gate and up blocks alternating (AMX)");
  m.def("small_gemm_argmax", &kvrelay::small_gemm_argmax, nogil, "argmax over columns of small_gemm(x, w) per row");
  m.def("small_gemm_available", &kvrelay::small_gemm_available, "whether small_gemm was built (AVX2 + FMA or AVX512)");
  m.def("amx_tiles", &kvrelay::amx_tiles, "whether bf16 kernels run on AMX tiles here");
  m.def("skinny_linear", &kvrelay::skinny_linear, nogil, "y = x w^T + b for a few rows, each independent of the others");
  m.def("gguf_gemm", &kvrelay::gguf_gemm, nogil, "y = x w^T + b, w in a GGUF block format (Q4_0, Q4_1, Q8_0)");
  m.def("gguf_any_rows", &kvrelay::gguf_any_rows, "whether gguf_gemm takes blocks of this ggml type at any number of rows");
  m.def("gguf_dequantize", &kvrelay::gguf_dequantize, nogil, "GGUF block rows back to fp32");
  m.def("gguf_decoder_layers", &kvrelay::gguf_decoder_layers, nogil,
        "every decoder layer of a Llama-family model on GGUF blocks in one call -> (hidden, residual)");
  m.def("lora_add", &kvrelay::lora_add, nogil,
        "y += B[slot] A[slot] x per row, rows of many LoRA adapters (and of none: slot -1) in one batch");
  m.def("rope_write_kv", &kvrelay::rope_write_kv, nogil, "rotate q, k in place and write k, v into the paged cache");
}
