// The Python module of the CPU kernels (one extension, built once per machine by shared/engine/kernels).
#include <torch/extension.h>

#include <optional>
#include <vector>

namespace kvrelay {
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t window);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                                        double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_write_kv(torch::Tensor qk, torch::Tensor v, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                   std::optional<torch::Tensor> kv_cache, std::optional<torch::Tensor> slot_mapping, int64_t heads);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias);
}  // namespace kvrelay

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &kvrelay::paged_decode, "paged decode attention over the KV cache, in place");
  m.def("add_rms_norm", &kvrelay::add_rms_norm, "residual += x; rms_norm(residual) * w -> (out, residual)");
  m.def("silu_mul", &kvrelay::silu_mul, "silu(gate) * up over a fused gate|up row");
  m.def("skinny_linear", &kvrelay::skinny_linear, "y = x w^T + b for a few rows, each independent of the others");
  m.def("rope_write_kv", &kvrelay::rope_write_kv, "rotate q, k in place and write k, v into the paged cache");
}
