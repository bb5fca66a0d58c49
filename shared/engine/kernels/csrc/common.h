// Small helpers shared by the CPU kernels: fp32 views of bf16 data, vectorisable row loops, prefetch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVRELAY_AVX2 1  // the kernels' hand-vectorised paths
#endif

namespace kvrelay {

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;  // bf16 is the top half of fp32
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch does (NaN kept quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// A row as fp32: fp32 data is used in place, bf16 is widened into `buf`.
inline const float* as_f32(const float* src, float* /*buf*/, int64_t /*n*/) { return src; }
inline const float* as_f32(const at::BFloat16* src, float* buf, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_f32(s[i]);
  return buf;
}
template <typename T>
inline const float* as_f32_n(const T* src, float* buf, int64_t n) { return as_f32(src, buf, n); }

inline void store_n(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void store_n(const float* src, at::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
}

#ifdef KVRELAY_AVX2
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

template <int D>
inline float dot(const float* a, const float* b, int64_t d_arg) {
#ifdef KVRELAY_AVX2
  if constexpr (D > 0 && D % 32 == 0) {
    // Four independent accumulators: one chain of D/8 dependent FMAs would wait on their latency.
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 16
    for (int i = 0; i < D; i += 32)
      for (int j = 0; j < 4; ++j)
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j), acc[j]);
    return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
#endif
  const int64_t d = D > 0 ? D : d_arg;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

template <int D>
inline void axpy(float a, const float* x, float* y, int64_t d_arg) {
  const int64_t d = D > 0 ? D : d_arg;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * x[i];
}

#ifdef KVRELAY_AVX2
// exp for x <= 0 (softmax after subtracting the max): 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial,
// within 1 ulp of expf over [-87, 0]; below -87.3 it returns 0 where expf returns a denormal (negligible
// beside the max's 1).
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

// Softmax of one row in place; vectorised: the scalar expf calls were a fifth of decode attention's time.
inline void softmax_inplace(float* s, int64_t n) {
  const float m = *std::max_element(s, s + n);
  float sum = 0.f;
  int64_t j = 0;
#ifdef KVRELAY_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) sum += v;
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

// Ask for bytes ahead of use: KV blocks are scattered, so the hardware prefetcher loses the stream at every
// block boundary and a single walker would wait on DRAM latency there.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 0);
}

}  // namespace kvrelay
