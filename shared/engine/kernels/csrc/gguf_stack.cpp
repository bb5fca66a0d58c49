// Every decoder layer of a Llama-family model whose projections are all GGUF blocks, in one call: what
// models/llama.py's DecoderLayer.forward does, op for op, calling the same kernels in the same order with the
// same dtype roundings, so the result is the same bits. Why: on two cores a single-stream decode step of the
// default model spent ~45% of its time in Python between the kernels (perf: the second OpenMP thread spun
// that long waiting for work), about as long as the GEMMs themselves; here nothing but the kernels remains.
// models/gguf_stack.py decides when this applies (no LoRA rows, no image rows, no per-layer callback).
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "api.h"

namespace kvrelay {

namespace {
// Per layer in `tensors`: input norm weight, q|k|v blocks, o blocks, post-attention norm weight, gate|up blocks,
// down blocks. In `qtypes`: the four projections' ggml types.
constexpr int64_t kTensorsPerLayer = 6, kTypesPerLayer = 4;

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  return gguf_gemm(x, blocks, qtype, std::nullopt).to(x.scalar_type());
}
}  // namespace

std::vector<at::Tensor> gguf_decoder_layers(TensorArg h_in, const std::vector<at::Tensor>& tensors,
                                            const std::vector<int64_t>& qtypes,
                                            const std::vector<at::Tensor>& kv_caches, TensorArg cos, TensorArg sin,
                                            TensorArg positions, TensorArg slot_mapping, TensorArg block_tables,
                                            TensorArg query_start_loc, TensorArg seq_lens, int64_t num_decodes,
                                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                                            double scale) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * kTensorsPerLayer &&
                  static_cast<int64_t>(qtypes.size()) == layers * kTypesPerLayer,
              "gguf_decoder_layers: ", kTensorsPerLayer, " tensors and ", kTypesPerLayer, " types per layer");
  TORCH_CHECK(h_in.dim() == 2, "gguf_decoder_layers: hidden states must be [T, hidden]");
  const int64_t t = h_in.size(0), nh = num_heads, nkv = num_kv_heads, d = head_dim;
  at::Tensor h = h_in;
  std::optional<at::Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = tensors.data() + l * kTensorsPerLayer;
    const int64_t* qt = qtypes.data() + l * kTypesPerLayer;
    std::vector<at::Tensor> normed = add_rms_norm(h, residual, w[0], eps);
    residual = normed[1];
    const at::Tensor qkv = linear(normed[0], w[1], qt[0]);
    const at::Tensor qk = qkv.narrow(1, 0, (nh + nkv) * d).view({t, nh + nkv, d});
    rope_write_kv(qk, qk.narrow(1, 0, 0), cos, sin, positions, std::nullopt, std::nullopt, nh + nkv);
    const at::Tensor v = qkv.narrow(1, (nh + nkv) * d, nkv * d).view({t, nkv, d});
    const at::Tensor attn = paged_attention(qk.narrow(1, 0, nh), qk.narrow(1, nh, nkv), v, kv_caches[l],
                                            slot_mapping, block_tables, query_start_loc, seq_lens, num_decodes,
                                            scale, 0);
    const at::Tensor o = linear(attn.reshape({t, nh * d}), w[2], qt[1]);
    normed = add_rms_norm(o, residual, w[3], eps);
    residual = normed[1];
    h = linear(silu_mul(linear(normed[0], w[4], qt[2])), w[5], qt[3]);
  }
  return {h, residual.value_or(h)};
}

}  // namespace kvrelay
