// Small helpers shared by the CPU kernels: fp32 views of bf16 data, vectorisable row loops, prefetch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

template <int D>
inline float dot(const float* a, const float* b, int64_t d_arg) {
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

inline void softmax_inplace(float* s, int64_t n) {
  const float m = *std::max_element(s, s + n);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
}

// Ask for bytes ahead of use: KV blocks are scattered, so the hardware prefetcher loses the stream at every
// block boundary and a single walker would wait on DRAM latency there.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 0);
}

}  // namespace kvrelay
