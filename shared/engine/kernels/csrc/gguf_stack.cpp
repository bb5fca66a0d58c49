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
// Per layer in `tensors`: the input norm's weight, the post-attention norm's weight, then the blocks of q|k|v, o,
// gate|up and down, each projection as `parts` of them (more than one where its shards came in different types:
// their outputs side by side), each part with its ggml type in `qtypes`.
constexpr int64_t kProjections = 4;

struct Cursor {  // walks `tensors` and `qtypes` in order
  const std::vector<at::Tensor>& tensors;
  const std::vector<int64_t>& qtypes;
  const std::vector<int64_t>& parts;
  size_t tensor = 0, qtype = 0, projection = 0;

  const at::Tensor& next_tensor() {
    TORCH_CHECK(tensor < tensors.size(), "gguf_decoder_layers: fewer tensors than the layers need");
    return tensors[tensor++];
  }

  at::Tensor linear(const at::Tensor& x) {  // the next projection, y = x W^T in x's dtype
    TORCH_CHECK(projection < parts.size() && parts[projection] >= 1, "gguf_decoder_layers: bad part counts");
    const int64_t n = parts[projection++];
    std::vector<at::Tensor> ys;
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& blocks = next_tensor();
      TORCH_CHECK(qtype < qtypes.size(), "gguf_decoder_layers: fewer types than parts");
      ys.push_back(gguf_gemm(x, blocks, qtypes[qtype++], std::nullopt).to(x.scalar_type()));  // a no-op for fp32, bf16
    }
    return n == 1 ? ys[0] : at::cat(ys, 1);
  }
};
}  // namespace

std::vector<at::Tensor> gguf_decoder_layers(TensorArg h_in, const std::vector<at::Tensor>& tensors,
                                            const std::vector<int64_t>& qtypes, const std::vector<int64_t>& parts,
                                            const std::vector<at::Tensor>& kv_caches, TensorArg cos, TensorArg sin,
                                            TensorArg positions, TensorArg slot_mapping, TensorArg block_tables,
                                            TensorArg query_start_loc, TensorArg seq_lens, int64_t num_decodes,
                                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                                            double scale) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == layers * kProjections,
              "gguf_decoder_layers: ", kProjections, " part counts per layer");
  TORCH_CHECK(h_in.dim() == 2, "gguf_decoder_layers: hidden states must be [T, hidden]");
  const int64_t t = h_in.size(0), nh = num_heads, nkv = num_kv_heads, d = head_dim;
  Cursor next{tensors, qtypes, parts};
  at::Tensor h = h_in;
  std::optional<at::Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& input_norm = next.next_tensor();
    const at::Tensor& post_norm = next.next_tensor();
    std::vector<at::Tensor> normed = add_rms_norm(h, residual, input_norm, eps);
    residual = normed[1];
    const at::Tensor qkv = next.linear(normed[0]);
    const at::Tensor qk = qkv.narrow(1, 0, (nh + nkv) * d).view({t, nh + nkv, d});
    rope_write_kv(qk, qk.narrow(1, 0, 0), cos, sin, positions, std::nullopt, std::nullopt, nh + nkv);
    const at::Tensor v = qkv.narrow(1, (nh + nkv) * d, nkv * d).view({t, nkv, d});
    const at::Tensor attn = paged_attention(qk.narrow(1, 0, nh), qk.narrow(1, nh, nkv), v, kv_caches[l],
                                            slot_mapping, block_tables, query_start_loc, seq_lens, num_decodes,
                                            scale, 0);
    const at::Tensor o = next.linear(attn.reshape({t, nh * d}));
    normed = add_rms_norm(o, residual, post_norm, eps);
    residual = normed[1];
    h = next.linear(silu_mul(next.linear(normed[0])));
  }
  TORCH_CHECK(next.tensor == tensors.size() && next.qtype == qtypes.size(),
              "gguf_decoder_layers: more tensors or types than the layers use");
  return {h, residual.value_or(h)};
}

}  // namespace kvrelay
