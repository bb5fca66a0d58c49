// The functions of the Python module (bindings.cpp), declared once for it and for the files defining them.
//
// They run without the GIL, so tensors come in by const reference: pybind moves a by-value tensor out of its
// caster, and dropping it when the call returns (C++ refcount 2 -> 1) releases the Python object, which takes
// the GIL back. In a node that waited on the event loop's Python for up to a switch interval, with the other
// core idle: ~10% of the engine thread's time in a served run (py-spy, docs/results/2026-11-25-zen5/NOTES.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace kvrelay {

using TensorArg = const at::Tensor&;
using OptTensorArg = const std::optional<at::Tensor>&;

at::Tensor paged_attention(TensorArg q, OptTensorArg k, OptTensorArg v, TensorArg kv_cache, OptTensorArg slot_mapping,
                           TensorArg block_tables, TensorArg query_start_loc, TensorArg seq_lens, int64_t num_decodes,
                           double scale, int64_t window);
std::string attention_isa();
std::vector<at::Tensor> add_rms_norm(TensorArg x, OptTensorArg residual, TensorArg weight, double eps);
at::Tensor silu_mul(TensorArg gate_up);
void rope_write_kv(TensorArg qk, TensorArg v, TensorArg cos, TensorArg sin, TensorArg positions, OptTensorArg kv_cache,
                   OptTensorArg slot_mapping, int64_t heads);
at::Tensor pack_small_gemm(TensorArg w);
at::Tensor small_gemm(TensorArg x, TensorArg packed, int64_t n, OptTensorArg bias);
at::Tensor small_gemm_argmax(TensorArg x, TensorArg packed, int64_t n);
at::Tensor small_gemm_silu_mul(TensorArg x, TensorArg packed, int64_t n);
bool small_gemm_available();
// Whether bf16 kernels run on AMX tiles here (built for them, the OS lets this process use them, not switched off).
bool amx_tiles();
at::Tensor skinny_linear(TensorArg x, TensorArg w, OptTensorArg bias);
// y = x W^T + b, W [N, row bytes] in a GGUF block format (ggml type 2 Q4_0, 3 Q4_1, 8 Q8_0, 12-14 the K-quants;
// gguf_gemm.cpp), y in bf16 for bf16 x and in fp32 otherwise; and those rows back as fp32 [R, K].
at::Tensor gguf_gemm(TensorArg x, TensorArg w, int64_t qtype, OptTensorArg bias);
at::Tensor gguf_dequantize(TensorArg w, int64_t qtype, int64_t k);
// Whether gguf_gemm runs blocks of this type on its int8 kernel at any number of rows (gguf_wide.h: Q4_0, Q4_1 and
// Q8_0 with AVX512-VNNI); otherwise past 128 rows the caller's dequantized tiles are faster.
bool gguf_any_rows(int64_t qtype);
// Every decoder layer of a Llama-family model on GGUF blocks, as DecoderLayer.forward computes them (gguf_stack.cpp):
// returns (hidden, residual) before the final norm.
std::vector<at::Tensor> gguf_decoder_layers(TensorArg h, const std::vector<at::Tensor>& tensors,
                                            const std::vector<int64_t>& qtypes, const std::vector<int64_t>& parts,
                                            const std::vector<at::Tensor>& kv_caches, TensorArg cos, TensorArg sin,
                                            TensorArg positions, TensorArg slot_mapping, TensorArg block_tables,
                                            TensorArg query_start_loc, TensorArg seq_lens, int64_t num_decodes,
                                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                                            double scale);
// y[t] += B[slots[t]] A[slots[t]] x[t] for the rows with a LoRA slot >= 0 (lora.cpp).
void lora_add(TensorArg y, TensorArg x, TensorArg a, TensorArg bt, TensorArg slots,
              const std::vector<int64_t>& shard_cols);

}  // namespace kvrelay
