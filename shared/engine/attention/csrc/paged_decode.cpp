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

// A K/V row as fp32: fp32 caches are read in place, bf16 rows are widened into `buf`.
inline const float* row_f32(const float* src, float* /*buf*/, int64_t /*d*/) { return src; }

inline const float* row_f32(const at::BFloat16* src, float* buf, int64_t d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* o = reinterpret_cast<uint32_t*>(buf);
  for (int64_t i = 0; i < d; ++i) o[i] = static_cast<uint32_t>(s[i]) << 16;  // bf16 is the top half of fp32
  return buf;
}

// Ask for bytes ahead of use: blocks are scattered, so the hardware prefetcher loses the stream at every
// block boundary and a single walker would wait on DRAM latency there.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 0);
}

constexpr int64_t kAhead = 4;  // blocks prefetched ahead of the one in use

// Scores (pass 1 over K) and the weighted sum of values (pass 2 over V) for kv heads [h0, h0 + nh) of one
// request. With all kv heads in one item a block's rows are read as one contiguous run. q and out point at
// head h0 * group. D > 0 fixes the head size at compile time (fully unrolled, vectorised row loops).
template <typename T, int D>
void decode_heads(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t seq_len,
                  int64_t first, int64_t bs, int64_t kvh, int64_t h0, int64_t nh, int64_t group, int64_t d_arg,
                  float scale, float* out, std::vector<float>& scores, std::vector<float>& buf) {
  const int64_t d = D > 0 ? D : d_arg;
  const int64_t n = seq_len - first;
  const int64_t rows_q = nh * group;  // query heads served by this item
  scores.resize(rows_q * n);
  buf.resize(d);
  const int64_t token_stride = kvh * d;
  const int64_t block_stride = bs * token_stride;
  const int64_t b_first = first / bs, b_last = (seq_len - 1) / bs;
  // fn(j, hh, row) for every context token j (0-based from `first`) and kv head hh, block by block, with the
  // blocks kAhead further on prefetched (one run of nh * d values per token).
  auto walk = [&](const T* cache, auto&& fn) {
    auto block_at = [&](int64_t b) { return cache + int64_t(table[b]) * block_stride + h0 * d; };
    auto fetch = [&](int64_t b) {
      for (int64_t t = 0; t < bs; ++t) prefetch(block_at(b) + t * token_stride, nh * d * int64_t(sizeof(T)));
    };
    for (int64_t b = b_first; b <= std::min(b_last, b_first + kAhead - 1); ++b) fetch(b);
    for (int64_t b = b_first; b <= b_last; ++b) {
      if (b + kAhead <= b_last) fetch(b + kAhead);
      const T* blk = block_at(b);
      const int64_t t0 = std::max(first, b * bs), t1 = std::min(seq_len, (b + 1) * bs);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t hh = 0; hh < nh; ++hh)
          fn(t - first, hh, row_f32(blk + (t - b * bs) * token_stride + hh * d, buf.data(), d));
    }
  };
  walk(k_cache, [&](int64_t j, int64_t hh, const float* k) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + (hh * group + g) * d;
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc += qg[i] * k[i];
      scores[(hh * group + g) * n + j] = acc * scale;
    }
  });
  for (int64_t row = 0; row < rows_q; ++row) {
    float* s = scores.data() + row * n;
    const float m = *std::max_element(s, s + n);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
  std::fill(out, out + rows_q * d, 0.f);
  walk(v_cache, [&](int64_t j, int64_t hh, const float* v) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[(hh * group + g) * n + j];
      float* o = out + (hh * group + g) * d;
      for (int64_t i = 0; i < d; ++i) o[i] += p * v[i];
    }
  });
}

template <typename T, int D>
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
  // A whole request per item reads its blocks contiguously; with fewer requests than threads, split by kv
  // head so every thread has work.
  const int64_t per_item = nd >= at::get_num_threads() ? kvh : 1;
  const int64_t items_per_req = kvh / per_item;
  at::parallel_for(0, nd * items_per_req, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / items_per_req, h0 = (item % items_per_req) * per_item;
      const int64_t seq_len = lp[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const int64_t head0 = h0 * group;
      decode_heads<T, D>(qp + (r * heads + head0) * d, k_cache, v_cache, tp + r * table_stride, seq_len, first,
                         bs, kvh, h0, per_item, group, d, static_cast<float>(scale), op + (r * heads + head0) * d,
                         scores, buf);
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
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32 || kv_cache.scalar_type() == torch::kBFloat16,
              "kv_cache dtype must be float32 or bfloat16");
  const bool f32 = kv_cache.scalar_type() == torch::kFloat32;
  const int64_t d = q.size(2);
  if (d == 64) {
    f32 ? run<float, 64>(q, kv_cache, block_tables, seq_lens, scale, window, out)
        : run<at::BFloat16, 64>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  } else if (d == 128) {
    f32 ? run<float, 128>(q, kv_cache, block_tables, seq_lens, scale, window, out)
        : run<at::BFloat16, 128>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  } else {
    f32 ? run<float, 0>(q, kv_cache, block_tables, seq_lens, scale, window, out)
        : run<at::BFloat16, 0>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
