// Fused elementwise work around the GEMMs of a llama-family layer, one pass over memory each instead of the
// 3-6 torch ops (and as many passes) they replace:
//   add_rms_norm    residual += x; out = rms_norm(residual) * w     (or just the norm when residual is None)
//   silu_mul        out = silu(gate) * up over a fused gate|up projection
//   rope_write_kv   rotate q and k in place (neox style) and write k, v into their paged-cache slots
// Arithmetic follows HF transformers' eager formulas, in the same order and with the same dtype roundings: the
// elementwise parts match them to the last bit (the rotary embedding exactly, in fp32 and bf16); a norm's sum
// of squares is vectorised, so it may differ in its last bit.
#pragma GCC optimize("fp-contract=off")  // no FMAs: every product rounds on its own, as in the eager ops

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "api.h"
#include "common.h"
#include "vec.h"

namespace kvrelay {
namespace {

// A value as the tensor's dtype holds it (bf16 rounds), kept in fp32 for the next operation.
template <typename T>
inline float round_to(float v) {
  return std::is_same<T, float>::value ? v : bf16_to_f32(f32_to_bf16(v));
}

// Rows per thread: up to ~64K elements run on the calling thread alone (a decode step's batch). A parallel
// region there costs more than the work, and its barrier stalls whenever the OS lends a core to a serving process.
inline int64_t serial_rows(int64_t n) { return std::max<int64_t>(1, 65536 / n); }

#if defined(KVRELAY_AVX512)
// silu(gate) * up for 16 lanes (F.silu in the model dtype, then .mul_(up)); the caller rounds the product.
template <typename T>
inline __m512 silu_mul16(__m512 x, __m512 up) {
  const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
  return _mm512_mul_ps(round_to16<T>(s), up);
}
#endif

template <typename T>
void add_rms_norm_impl(T* x, T* residual, const T* w, T* out, int64_t rows, int64_t n, int64_t x_stride,
                       double eps) {
  at::parallel_for(0, rows, serial_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      T* rr = residual != nullptr ? residual + r * n : nullptr;
      float ss = 0.f;
#if defined(KVRELAY_AVX512)
      if (n % 16 == 0) {  // the same roundings, 16 lanes at a time; the sum of squares in another order
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
          __m512 v = load16(xr + i);
          if (rr != nullptr) {
            v = round_to16<T>(_mm512_add_ps(load16(rr + i), v));
            store16(rr + i, v);
          }
          _mm512_storeu_ps(row.data() + i, v);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) +
                                                          static_cast<float>(eps)));
        T* o = out + r * n;
        for (int64_t i = 0; i < n; i += 16)
          store16(o + i, _mm512_mul_ps(load16(w + i), round_to16<T>(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), inv))));
        continue;
      }
#endif
      for (int64_t i = 0; i < n; ++i) {
        float v = load(xr, i);
        if (rr != nullptr) {
          v = round_to<T>(load(rr, i) + v);  // residual.add_(x) in the model dtype
          put(rr, i, v);
        }
        row[i] = v;
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) put(o, i, load(w, i) * round_to<T>(row[i] * inv));
    }
  });
}

template <typename T>
void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t n, int64_t gu_stride) {
  at::parallel_for(0, rows, serial_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * gu_stride;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;
#if defined(KVRELAY_AVX512)
      for (; i + 16 <= n; i += 16) store16(o + i, silu_mul16<T>(load16(g + i), load16(u + i)));
#endif
#ifdef KVRELAY_AVX2
      // Vectorised exp (within 1 ulp of expf; std::exp per element was most of this kernel's time).
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= n; i += 8) {
        const __m256 x = load8(g + i);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 s = round_to8<T>(_mm256_div_ps(x, _mm256_add_ps(one, e)));
        store8(o + i, _mm256_mul_ps(s, load8(u + i)));
      }
#endif
      for (; i < n; ++i) {
        const float x = load(g, i);
        const float s = round_to<T>(x / (1.f + std::exp(-x)));  // F.silu, in the model dtype
        put(o, i, s * load(u, i));                               // .mul_(up)
      }
    }
  });
}

// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (each product rounded to the dtype, as the eager ops do).
// Vectorised with the same per-lane operations, so every lane rounds exactly as the scalar loop does.
template <typename T>
inline void rotate(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t i = 0;
#if defined(KVRELAY_AVX512)
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + half + i), c = load16(cos + i), s = load16(sin + i);
    const __m512 a = round_to16<T>(_mm512_mul_ps(x1, c)), b = round_to16<T>(_mm512_mul_ps(x2, s));
    const __m512 e = round_to16<T>(_mm512_mul_ps(x2, c)), f = round_to16<T>(_mm512_mul_ps(x1, s));
    store16(x + i, _mm512_sub_ps(a, b));
    store16(x + half + i, _mm512_add_ps(e, f));
  }
#endif
#ifdef KVRELAY_AVX2
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8(x + i), x2 = load8(x + half + i), c = load8(cos + i), s = load8(sin + i);
    const __m256 a = round_to8<T>(_mm256_mul_ps(x1, c)), b = round_to8<T>(_mm256_mul_ps(x2, s));
    const __m256 e = round_to8<T>(_mm256_mul_ps(x2, c)), f = round_to8<T>(_mm256_mul_ps(x1, s));
    store8(x + i, _mm256_sub_ps(a, b));
    store8(x + half + i, _mm256_add_ps(e, f));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = load(x, i), x2 = load(x, half + i), c = load(cos, i), s = load(sin, i);
    const float a = round_to<T>(x1 * c), b = round_to<T>(x2 * s);
    const float e = round_to<T>(x2 * c), f = round_to<T>(x1 * s);
    put(x, i, a - b);
    put(x, half + i, e + f);
  }
}

template <typename T, typename C>
void rope_write_impl(T* qk, int64_t token_stride, const T* v, int64_t v_stride, const T* cos, const T* sin,
                     const int64_t* pos, C* cache, const int64_t* slots, int64_t tokens, int64_t heads,
                     int64_t kv_heads, int64_t d, int64_t num_slots) {
  const int64_t half = d / 2;
  C* kc = cache;
  C* vc = cache + num_slots * kv_heads * d;
  at::parallel_for(0, tokens, serial_rows((heads + kv_heads) * d), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      T* row = qk + t * token_stride;
      const T* c = cos + pos[t] * half;
      const T* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(row + h * d, c, s, half);
      if (slots == nullptr) continue;
      const int64_t slot = slots[t];
      for (int64_t i = 0; i < kv_heads * d; ++i) {
        put(kc + slot * kv_heads * d, i, load(row + heads * d, i));
        put(vc + slot * kv_heads * d, i, load(v + t * v_stride, i));
      }
    }
  });
}

void check_row_major(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

// Returns (out, residual). With a residual: residual += x in place and out = rms_norm(residual) * weight;
// without: out = rms_norm(x) * weight and x itself is the residual.
std::vector<torch::Tensor> add_rms_norm(TensorArg x, OptTensorArg residual, TensorArg weight, double eps) {
  check_row_major(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must match x's last dim and dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows, n}, x.options());
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "residual must be contiguous like x");
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        add_rms_norm_impl<float>(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                                 weight.data_ptr<float>(), out.data_ptr<float>(), rows, n, x.stride(0), eps);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        add_rms_norm_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(),
                                        residual ? residual->data_ptr<at::BFloat16>() : nullptr,
                                        weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n,
                                        x.stride(0), eps);
      }));
  return {out, residual.has_value() ? *residual : x};
}

// gate_up [T, 2n] (gate | up) -> silu(gate) * up [T, n]
torch::Tensor silu_mul(TensorArg gate_up) {
  check_row_major(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_mul",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        silu_mul_impl<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, n, gate_up.stride(0));
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        silu_mul_impl<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n,
                                    gate_up.stride(0));
      }));
  return out;
}

// qk [T, heads + kv_heads, d] (a view with contiguous heads), v [T, kv_heads, d]; cos, sin [max_pos, d/2];
// positions, slot_mapping [T] int64; kv_cache [2, nb, bs, kv_heads, d] or None (rotate only).
void rope_write_kv(TensorArg qk, TensorArg v, TensorArg cos, TensorArg sin, TensorArg positions,
                   OptTensorArg kv_cache, OptTensorArg slot_mapping, int64_t heads) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "qk must be [T, H, d], heads packed");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.stride(1) == v.size(2), "v must be [T, kvh, d], heads packed");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qk.scalar_type() &&
              sin.scalar_type() == qk.scalar_type(), "cos and sin: contiguous, in qk's dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "positions: int64");
  const int64_t tokens = qk.size(0), d = qk.size(2), kv_heads = qk.size(1) - heads;
  TORCH_CHECK(d % 2 == 0 && cos.size(1) == d / 2, "cos/sin must hold d/2 values per position");
  const int64_t* slots = nullptr;
  int64_t num_slots = 0;
  if (kv_cache.has_value()) {
    TORCH_CHECK(kv_cache->is_contiguous() && kv_cache->dim() == 5 && kv_cache->size(3) == kv_heads &&
                kv_cache->size(4) == d, "kv_cache must be contiguous [2, nb, bs, kv_heads, d]");
    TORCH_CHECK(slot_mapping.has_value() && slot_mapping->scalar_type() == torch::kInt64 &&
                slot_mapping->is_contiguous(), "slot_mapping: int64");
    slots = slot_mapping->data_ptr<int64_t>();
    num_slots = kv_cache->size(1) * kv_cache->size(2);
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  auto go = [&](auto* q, auto* vv, auto* c, auto* s, auto* cache) {
    rope_write_impl(q, qk.stride(0), vv, v.stride(0), c, s, pos, cache, slots, tokens, heads, kv_heads, d, num_slots);
  };
  const bool cache_f32 = !kv_cache.has_value() || kv_cache->scalar_type() == torch::kFloat32;
  TORCH_CHECK(!kv_cache.has_value() || cache_f32 || kv_cache->scalar_type() == torch::kBFloat16,
              "kv_cache dtype: float32 or bfloat16");
  if (qk.scalar_type() == torch::kFloat32) {
    auto* q = qk.data_ptr<float>();
    if (cache_f32) go(q, v.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                      kv_cache ? kv_cache->data_ptr<float>() : static_cast<float*>(nullptr));
    else go(q, v.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
            kv_cache->data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(qk.scalar_type() == torch::kBFloat16, "qk dtype: float32 or bfloat16");
    auto* q = qk.data_ptr<at::BFloat16>();
    if (cache_f32) go(q, v.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                      kv_cache ? kv_cache->data_ptr<float>() : static_cast<float*>(nullptr));
    else go(q, v.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
            kv_cache->data_ptr<at::BFloat16>());
  }
}

#if defined(KVRELAY_AVX512)
void silu_mul_sums16(const float* gate, const float* up, at::BFloat16* out) {
  store16(out, silu_mul16<at::BFloat16>(round_to16<at::BFloat16>(_mm512_loadu_ps(gate)),
                                        round_to16<at::BFloat16>(_mm512_loadu_ps(up))));
}
#endif

}  // namespace kvrelay
