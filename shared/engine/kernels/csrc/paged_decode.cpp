// Paged attention for single-token decodes on CPU, reading keys and values in place from the block table
// (no gather copy). One work item = one request (or, with fewer requests than threads, one of its kv heads):
// the query heads sharing a kv head use every K/V row it loads, so the KV cache is read exactly once.
// Scores and accumulation in fp32; queries and the cache may each be fp32 or bf16.
#pragma GCC optimize("fp-contract=fast")  // FMAs in the dot products: speed over bit-exactness here

#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace kvrelay {
namespace {

constexpr int64_t kAhead = 4;  // blocks prefetched ahead of the one in use

#ifdef KVRELAY_AVX2
// out[g] += sum over tokens [t0, t1) of p[g][t] v_t for G query rows sharing one kv head: each V row is loaded
// (and widened) once for all G rows. 16 lanes at a time keep 2G accumulators in registers. Per element the
// sum runs over the block's tokens in order, then adds to out: the same order as axpy row by row.
template <int G, int D, typename T>
inline void pv_rows(const float* p, int64_t p_stride, const T* v, int64_t v_stride, int64_t t0, int64_t t1,
                    float* out) {
  for (int c = 0; c < D; c += 16) {
    __m256 acc[G][2];
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      const T* vt = v + t * v_stride + c;
      const __m256 a = load8(vt), b = load8(vt + 8);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_set1_ps(p[g * p_stride + t]);
        acc[g][0] = _mm256_fmadd_ps(w, a, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(w, b, acc[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* o = out + g * D + c;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[g][0]));
      _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), acc[g][1]));
    }
  }
}
#endif

// Scores (pass 1 over K) and the weighted sum of values (pass 2 over V) for kv heads [h0, h0 + nh) of one
// request. q and out point at head h0 * group, fp32. D > 0 fixes the head size at compile time.
template <typename T, int D>
void decode_heads(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t seq_len,
                  int64_t first, int64_t bs, int64_t kvh, int64_t h0, int64_t nh, int64_t group, int64_t d_arg,
                  float scale, float* out, std::vector<float>& scores) {
  const int64_t d = D > 0 ? D : d_arg;
  const int64_t n = seq_len - first;
  const int64_t rows_q = nh * group;  // query heads served by this item
  scores.resize(rows_q * n);
  const int64_t token_stride = kvh * d;
  const int64_t block_stride = bs * token_stride;
  const int64_t b_first = first / bs, b_last = (seq_len - 1) / bs;
  auto block_at = [&](const T* cache, int64_t b) { return cache + int64_t(table[b]) * block_stride + h0 * d; };
  auto fetch = [&](const T* cache, int64_t b) {
    for (int64_t t = 0; t < bs; ++t) prefetch(block_at(cache, b) + t * token_stride, nh * d * int64_t(sizeof(T)));
  };
  // Pass 1: scores[row, j] = scale * q_row . k_j
  for (int64_t b = b_first; b <= std::min(b_last, b_first + kAhead - 1); ++b) fetch(k_cache, b);
  for (int64_t b = b_first; b <= b_last; ++b) {
    if (b + kAhead <= b_last) fetch(k_cache, b + kAhead);
    const T* blk = block_at(k_cache, b);
    const int64_t t0 = std::max(first, b * bs), t1 = std::min(seq_len, (b + 1) * bs);
    for (int64_t hh = 0; hh < nh; ++hh) {
      const T* k0 = blk + hh * d - b * bs * token_stride;  // + t * token_stride: key t of this head
      for (int64_t g = 0; g < group; ++g) {
        const float* qr = q + (hh * group + g) * d;
        float* sr = scores.data() + (hh * group + g) * n - first;
        int64_t t = t0;
#ifdef KVRELAY_AVX2
        if constexpr (D > 0 && D % 8 == 0)
          for (; t + 4 <= t1; t += 4) {
            const T* k = k0 + t * token_stride;
            _mm_storeu_ps(sr + t, _mm_mul_ps(dot4<D>(qr, k, k + token_stride, k + 2 * token_stride,
                                                      k + 3 * token_stride), _mm_set1_ps(scale)));
          }
#endif
        for (; t < t1; ++t) sr[t] = dot<D>(qr, k0 + t * token_stride, d) * scale;
      }
    }
  }
  for (int64_t row = 0; row < rows_q; ++row) softmax_inplace(scores.data() + row * n, n);
  // Pass 2: out[row] = sum_j p[row, j] v_j, accumulated per block in registers (D floats per row).
  std::fill(out, out + rows_q * d, 0.f);
  for (int64_t b = b_first; b <= std::min(b_last, b_first + kAhead - 1); ++b) fetch(v_cache, b);
  for (int64_t b = b_first; b <= b_last; ++b) {
    if (b + kAhead <= b_last) fetch(v_cache, b + kAhead);
    const T* blk = block_at(v_cache, b);
    const int64_t t0 = std::max(first, b * bs), t1 = std::min(seq_len, (b + 1) * bs);
    for (int64_t hh = 0; hh < nh; ++hh) {
      int64_t g = 0;
#ifdef KVRELAY_AVX2
      // bf16 caches only: sharing the widened V rows pays there; with an fp32 cache it measured 5-15% slower
      // than row by row (same sums, same order either way).
      if constexpr (D > 0 && D % 16 == 0 && !std::is_same<T, float>::value) {
        const T* v0 = blk + hh * d - b * bs * token_stride;
        const float* p0 = scores.data() + hh * group * n - first;
        float* o0 = out + hh * group * d;
        for (; g + 3 <= group; g += 3) pv_rows<3, D>(p0 + g * n, n, v0, token_stride, t0, t1, o0 + g * d);
        if (group - g == 2) pv_rows<2, D>(p0 + g * n, n, v0, token_stride, t0, t1, o0 + g * d);
        if (group - g == 1) pv_rows<1, D>(p0 + g * n, n, v0, token_stride, t0, t1, o0 + g * d);
        continue;
      }
#endif
      for (; g < group; ++g) {
        const int64_t row = hh * group + g;
        const float* p = scores.data() + row * n - first;
        float acc[D > 0 ? D : 256];
        for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
        for (int64_t t = t0; t < t1; ++t) axpy<D>(p[t], blk + (t - b * bs) * token_stride + hh * d, acc, d);
        float* o = out + row * d;
        for (int64_t i = 0; i < d; ++i) o[i] += acc[i];
      }
    }
  }
}

template <typename T, typename Q, int D>
void run(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const torch::Tensor& lens,
         double scale, int64_t window, torch::Tensor& out) {
  const int64_t nd = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t bs = kv.size(2), kvh = kv.size(3);
  const int64_t group = heads / kvh;
  const T* k_cache = reinterpret_cast<const T*>(kv[0].data_ptr());
  const T* v_cache = reinterpret_cast<const T*>(kv[1].data_ptr());
  const Q* qp = reinterpret_cast<const Q*>(q.data_ptr());
  Q* op = reinterpret_cast<Q*>(out.data_ptr());
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t table_stride = tables.size(1);
  const int threads = std::max(1, at::get_num_threads());
  // A whole request per item reads its blocks contiguously; with fewer requests than threads, split by kv
  // head so every thread has work. Items are handed out dynamically: context lengths differ a lot, and a
  // static split would leave one thread with the long ones.
  const int64_t per_item = nd >= threads ? kvh : 1;
  const int64_t items_per_req = kvh / per_item;
  const int64_t items = nd * items_per_req;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores, qf(heads * d), of(heads * d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t r = item / items_per_req, h0 = (item % items_per_req) * per_item;
      const int64_t seq_len = lp[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const int64_t head0 = h0 * group, rows = per_item * group;
      const float* qrow = as_f32_n(qp + (r * heads + head0) * d, qf.data(), rows * d);
      float* orow = std::is_same<Q, float>::value ? reinterpret_cast<float*>(op + (r * heads + head0) * d)
                                                  : of.data();
      decode_heads<T, D>(qrow, k_cache, v_cache, tp + r * table_stride, seq_len, first, bs, kvh, h0, per_item,
                         group, d, static_cast<float>(scale), orow, scores);
      if (!std::is_same<Q, float>::value) store_n(orow, op + (r * heads + head0) * d, rows * d);
    }
  }
}

template <typename T, typename Q>
void dispatch_d(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                const torch::Tensor& lens, double scale, int64_t window, torch::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<T, Q, 64>(q, kv, tables, lens, scale, window, out);
    case 128: return run<T, Q, 128>(q, kv, tables, lens, scale, window, out);
    default: return run<T, Q, 0>(q, kv, tables, lens, scale, window, out);
  }
}

}  // namespace

// q [nd, heads, d] fp32|bf16; kv_cache [2, num_blocks, bs, kvh, d] fp32|bf16; block_tables [nd, max_blocks]
// int32; seq_lens [nd] int32 (context including the new token, already written); window <= 0: full.
// Returns [nd, heads, d] in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be [nd, heads, d]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, "q: float32 or bfloat16");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous [2, nb, bs, kvh, d]");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32 || kv_cache.scalar_type() == torch::kBFloat16,
              "kv_cache dtype must be float32 or bfloat16");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) <= 256, "head size above 256");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const bool kf32 = kv_cache.scalar_type() == torch::kFloat32, qf32 = q.scalar_type() == torch::kFloat32;
  if (kf32 && qf32) dispatch_d<float, float>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  else if (kf32) dispatch_d<float, at::BFloat16>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  else if (qf32) dispatch_d<at::BFloat16, float>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  else dispatch_d<at::BFloat16, at::BFloat16>(q, kv_cache, block_tables, seq_lens, scale, window, out);
  return out;
}

}  // namespace kvrelay
