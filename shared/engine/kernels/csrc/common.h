// Small helpers shared by the CPU kernels: fp32 views of bf16, fp8 and int8 data, vectorisable row loops, prefetch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // every AVX2 CPU has FMA and F16C
#define KVRELAY_AVX2 1  // the kernels' hand-vectorised paths
#endif

namespace kvrelay {

// A KV cache of fp8 e4m3 numbers (--kv-cache-dtype fp8, vLLM's OCP e4m3fn: 4 exponent bits, bias 7, no
// infinities, largest finite 448): one byte a value, widened to fp32 where the kernels read it.
using Fp8 = c10::Float8_e4m3fn;

// e4m3 to fp32 exactly, subnormals included: the 7 magnitude bits placed at fp32's exponent/mantissa boundary read
// as 2^(e - 127) (1 + m/8) (or m 2^-149 for e == 0), which 2^120 rescales to e4m3's 2^(e - 7) (1 + m/8) (m 2^-9).
inline float fp8_to_f32(uint8_t b) {
  const uint32_t bits = static_cast<uint32_t>(b & 0x7f) << 20;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  f *= 0x1p120f;
  return (b & 0x80) ? -f : f;
}

// An int8 KV cache (--kv-cache-dtype int8): each head's row is d int8 values, value i standing for v_i * s_{i / 32}.
// Group g's fp16 scale s_g costs no bytes: its bit j is the lowest bit of the group's value 16 + j (the writer
// rounds those 16 values to the nearest integer of that parity). So an int8 row is half a bf16 row.
struct Q8 {
  int8_t v;
};
constexpr int64_t kQ8Group = 32;
constexpr int64_t kQ8Lead = 16;  // values of a group before those carrying its scale's bits
inline float half_bits_to_f32(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}
// The scale of the group holding value i of a row.
inline float q8_scale(const Q8* row, int64_t i) {
  const int8_t* high = &row[i / kQ8Group * kQ8Group + kQ8Lead].v;
#if defined(__SSE2__)
  // Each byte's lowest bit shifted to its top, where movemask collects the 16 of them in order.
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(high));
  return half_bits_to_f32(static_cast<uint16_t>(_mm_movemask_epi8(_mm_slli_epi16(x, 7))));
#else
  uint16_t bits = 0;
  for (int j = 0; j < 16; ++j) bits |= static_cast<uint16_t>((high[j] & 1) << j);
  return half_bits_to_f32(bits);
#endif
}

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

#ifdef KVRELAY_AVX2
// Eight values as fp32 lanes; bf16 is widened in registers (exact: bf16 is the top half of an fp32), so a
// bf16 cache costs no staging copy and half the memory traffic of an fp32 one.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// fp8 e4m3 widened in registers. Through fp16 (F16C): the byte sign-extended and shifted left by 7 puts the sign
// at bit 15, e4m3's exponent in fp16's low 4 exponent bits and its mantissa on top of fp16's, once bit 14 (a copy
// of the sign) is cleared; that fp16 is the value times 2^-8, subnormals included, and the hardware widens it
// exactly. (Placing the bits in fp32 instead fed subnormal fp32 numbers to a multiply: 1.3x slower decodes.)
inline __m128i fp8_as_f16x8(__m128i bytes) {
  const __m128i s = _mm_cvtepi8_epi16(bytes);
  return _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
}
inline __m256 load8(const Fp8* p) {
  const __m128i h = fp8_as_f16x8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
// Eight values from offset c (a multiple of 8) of a row: rows of an int8 cache need the row to find their scale.
template <typename T>
inline __m256 load8(const T* row, int64_t c) { return load8(row + c); }
inline __m256 load8(const Q8* row, int64_t c) {
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(x), _mm256_set1_ps(q8_scale(row, c)));
}
#endif

// Element i as fp32, and a value stored in the tensor's dtype (bf16 rounds to nearest even).
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) { return bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]); }
inline void put(float* p, int64_t i, float v) { p[i] = v; }
inline void put(at::BFloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = f32_to_bf16(v); }
inline float load(const Fp8* p, int64_t i) { return fp8_to_f32(reinterpret_cast<const uint8_t*>(p)[i]); }
// Rounded to nearest even and saturated at +-448, as torch's cast to float8_e4m3fn does.
inline void put(Fp8* p, int64_t i, float v) { p[i] = Fp8(std::isnan(v) ? v : std::clamp(v, -448.f, 448.f)); }
inline float load(const Q8* row, int64_t i) { return static_cast<float>(row[i].v) * q8_scale(row, i); }

// d values (any dtype load() reads) into an int8 row, as kvrelay.engine.attention.base.quantize_int8 does: per group
// of 32, s = fp16(absmax / 127) and y = x / s; values 0-15 round-half-even(y) clamped to [-127, 127], value 16 + j
// the integer nearest y whose lowest bit is bit j of s, clamped to [-127, 127] (odd) or [-126, 126] (even).
template <typename N>
inline void quantize_q8_row(const N* src, int64_t d, Q8* row) {
  for (int64_t g = 0; g < d / kQ8Group; ++g) {
    const int64_t first = g * kQ8Group;
    float amax = 0.f;
    for (int64_t i = first; i < first + kQ8Group; ++i) amax = std::max(amax, std::fabs(load(src, i)));
    const c10::Half scale(amax / 127.f);
    const float s = static_cast<float>(scale);
    for (int64_t i = first; i < first + kQ8Group; ++i) {
      const float y = s > 0.f ? load(src, i) / s : 0.f;  // s == 0: every value of the group is 0, and so is s
      if (i < first + kQ8Lead) {
        row[i].v = static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.f, 127.f));
      } else {
        const float bit = static_cast<float>((scale.x >> (i - first - kQ8Lead)) & 1);
        const float nearest = 2.f * std::nearbyint((y - bit) * 0.5f) + bit;
        row[i].v = static_cast<int8_t>(std::clamp(nearest, -126.f - bit, 126.f + bit));
      }
    }
  }
}

// a . b with a in fp32 and b in fp32 or bf16; the same sum, in the same order, for either type of b.
template <int D, typename T>
inline float dot(const float* a, const T* b, int64_t d_arg) {
#ifdef KVRELAY_AVX2
  if constexpr (D > 0 && D % 32 == 0) {
    // Four independent accumulators: one chain of D/8 dependent FMAs would wait on their latency.
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 16
    for (int i = 0; i < D; i += 32)
      for (int j = 0; j < 4; ++j)
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * j), load8(b, i + 8 * j), acc[j]);
    return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
#endif
  const int64_t d = D > 0 ? D : d_arg;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * load(b, i);
  return acc;
}

#ifdef KVRELAY_AVX2
// a . b0 .. a . b3 in one pass: four independent FMA chains and one shared horizontal reduction, where four
// dot() calls would pay four reductions (most of a 64-wide dot's cost).
template <int D, typename T>
inline __m128 dot4(const float* a, const T* b0, const T* b1, const T* b2, const T* b3) {
  static_assert(D > 0 && D % 8 == 0, "dot4 needs a head size that is a multiple of 8");
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < D; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    s0 = _mm256_fmadd_ps(av, load8(b0, i), s0);
    s1 = _mm256_fmadd_ps(av, load8(b1, i), s1);
    s2 = _mm256_fmadd_ps(av, load8(b2, i), s2);
    s3 = _mm256_fmadd_ps(av, load8(b3, i), s3);
  }
  // [s0 s1 s2 s3] of the low and high 128-bit halves, then their sum
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// y += a * x, x in fp32 or bf16.
template <int D, typename T>
inline void axpy(float a, const T* x, float* y, int64_t d_arg) {
#ifdef KVRELAY_AVX2
  if constexpr (D > 0 && D % 8 == 0) {
    const __m256 av = _mm256_set1_ps(a);
#pragma GCC unroll 16
    for (int i = 0; i < D; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x, i), _mm256_loadu_ps(y + i)));
    return;
  }
#endif
  const int64_t d = D > 0 ? D : d_arg;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * load(x, i);
}

#ifdef KVRELAY_AVX2
// exp on [-87.3, 88.3]: 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial, within 1 ulp of expf.
inline __m256 exp_core(__m256 x) {
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
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// exp for x <= 0 (softmax after subtracting the max); below -87.3 it returns 0 where expf returns a denormal
// (negligible beside the max's 1).
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  return _mm256_andnot_ps(under, exp_core(_mm256_max_ps(x, lo)));
}

// exp for any x: 0 below -87.3, +inf above 88.3 (expf overflows at 88.72; the last 0.4 are not needed here).
inline __m256 exp_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  const __m256 e = _mm256_andnot_ps(under, exp_core(_mm256_min_ps(_mm256_max_ps(x, lo), hi)));
  return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), over);
}

// fp32 lanes rounded to bf16 precision (nearest even, as torch rounds), kept as fp32; NaN stays NaN.
inline __m256i bf16_bits_rne(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256i quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x400000));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan));
}
inline __m256 round_bf16(__m256 x) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits_rne(x), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
// A value as the dtype T holds it (bf16 rounds), kept in fp32: round_to16's 8 lanes.
template <typename T>
inline __m256 round_to8(__m256 v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else return round_bf16(v);
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i hi = _mm256_srli_epi32(bf16_bits_rne(v), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
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
// block boundary and a single walker would wait on DRAM latency there. Which cache the rows are asked into is
// the machine's (the builder passes KVRELAY_PREFETCH_L2 on AMD; KVRELAY_KV_PREFETCH overrides it):
// - T0 (into L1, a load's hint), not NTA, on an AMX Xeon (2 vCPUs, KVM): the decode kernel stalled on its
//   prefetchnta, 3.1 -> 1.55 ms per layer at 64 decodes x 600 tokens in bf16 with T0, 5.8 -> 1.7 in fp32.
// - T1 (into L2) on an AVX512-BF16 EPYC (Zen 4, 2 vCPUs): T0 requests wait for the few L1 miss buffers there.
//   128 decodes x 600 tokens, one layer: fp32 6.83 -> 4.49 ms, bf16 4.22 -> 2.00 (17 -> 26 and 14 -> 29 GB/s);
//   a plain read of the same scattered rows 19 -> 28 GB/s. On a Zen 5 the hint made no difference.
// - AMD cores before Zen 4 (the AVX2-only EPYCs) fill L1 for every hint (AMD's optimisation guides; T1 into L2
//   is new with Zen 4), so there the L2 build behaves as the L1 one; `KVRELAY_KV_PREFETCH=l1` on a Zen 4 stands in
//   for them. Measured natively on a Zen 3 EPYC (2 vCPUs): L1, L2 and no prefetch within the noise, 32 decodes x
//   600 tokens fp32 2.1-2.4 ms per layer each.
// (docs/results/2026-11-26-xeon-amx, 2026-11-27-zen4 and 2026-11-28-zen3, NOTES.md)
inline void prefetch(const void* p, int64_t bytes) {
#ifdef KVRELAY_PREFETCH_L2
  constexpr int locality = 2;
#else
  constexpr int locality = 3;
#endif
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, locality);
}

}  // namespace kvrelay
