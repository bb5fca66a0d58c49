// Paged attention for single-token decodes on CPU, reading keys and values in place from the block table
// (no gather copy). One work item = one (request, kv head): its query heads share every K/V row it loads,
// which makes the kernel read the KV cache exactly once. Scores in fp32; the cache may be fp32 or bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline void load_row(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }

inline void load_row(const at::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* o = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < d; ++i) o[i] = static_cast<uint32_t>(s[i]) << 16;  // bf16 is the top half of fp32
}

template <typename T>
void decode_one(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t seq_len,
                int64_t first, int64_t bs, int64_t kvh, int64_t h, int64_t group, int64_t d, float scale,
                float* out, std::vector<float>& scores, std::vector<float>& row) {
  const int64_t n = seq_len - first;
  scores.assign(group * n, 0.f);
  row.resize(d);
  const int64_t token_stride = kvh * d;
  const int64_t block_stride = bs * token_stride;
  for (int64_t t = first; t < seq_len; ++t) {
    const int64_t off = int64_t(table[t / bs]) * block_stride + (t % bs) * token_stride + h * d;
    load_row(k_cache + off, row.data(), d);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc += qg[i] * row[i];
      scores[g * n + (t - first)] = acc * scale;
    }
  }
  std::vector<float> inv(group);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * n;
    const float m = *std::max_element(s, s + n);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    inv[g] = 1.f / sum;
  }
  std::fill(out, out + group * d, 0.f);
  for (int64_t t = first; t < seq_len; ++t) {
    const int64_t off = int64_t(table[t / bs]) * block_stride + (t % bs) * token_stride + h * d;
    load_row(v_cache + off, row.data(), d);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + (t - first)] * inv[g];
      float* o = out + g * d;
      for (int64_t i = 0; i < d; ++i) o[i] += p * row[i];
    }
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const torch::Tensor& lens,
         double scale, int64_t window, torch::Tensor& out) {
  const int64_t nd = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t bs = kv.size(2), kvh = kv.size(3);
  const int64_t group = heads / kvh;
  const T* k_cache = kv[0].data_ptr<T>();
  const T* v_cache = kv[1].data_ptr<T>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t table_stride = tables.size(1);
  at::parallel_for(0, nd * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kvh, h = item % kvh;
      const int64_t seq_len = lp[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const int64_t head0 = h * group;
      decode_one<T>(qp + (r * heads + head0) * d, k_cache, v_cache, tp + r * table_stride, seq_len, first, bs, kvh,
                    h, group, d, static_cast<float>(scale), op + (r * heads + head0) * d, scores, row);
    }
  });
}

}  // namespace

// q [nd, heads, d] fp32; kv_cache [2, num_blocks, bs, kvh, d] fp32|bf16; block_tables [nd, max_blocks] int32;
// seq_lens [nd] int32 (context including the new token, already written); window <= 0: full attention.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [nd, heads, d] float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous [2, nb, bs, kvh, d]");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  if (kv_cache.scalar_type() == torch::kFloat32) {
    run<float>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  } else if (kv_cache.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  } else {
    TORCH_CHECK(false, "kv_cache dtype must be float32 or bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
