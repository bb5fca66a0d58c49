// One fp32 vector type for the attention kernels, whatever the machine: 16 lanes with AVX512F, else 8 lanes
// with AVX2 + FMA. The kernels are written once against `Vf` and compiled for the machine they run on
// (-march=native). Also the AVX512-BF16 dot product of bf16 pairs, where the CPU has it.
#pragma once

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVRELAY_AVX512 1
#if defined(__AVX512BF16__)
#define KVRELAY_AVX512BF16 1  // bf16 dot products in hardware (vdpbf16ps)
#endif
#endif

namespace kvrelay {

#if defined(KVRELAY_AVX512)
struct Vf {
  using R = __m512;
  static constexpr int W = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  // a where keep (a <= b, compared lane by lane), else -inf
  static R keep_le(R a, R x, R y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, y, _CMP_LE_OQ), set1(-INFINITY), a);
  }
  static R keep_gt(R a, R x, R y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, y, _CMP_GT_OQ), set1(-INFINITY), a);
  }
  static R select_if_neg_inf(R x, R when_inf) {  // when_inf where x == -inf, else x
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set1(-INFINITY), _CMP_EQ_OQ), x, when_inf);
  }
  // exp for x <= 0 (x may be -inf): 0 below -87.3, as exp_neg (common.h) does for 8 lanes.
  static R exp_neg(R x) {
    const R lo = set1(-87.3f);
    const __mmask16 ok = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const R n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    R r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    R p = set1(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, set1(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, set1(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, set1(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, set1(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, set1(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, set1(1.f)));
    return _mm512_maskz_mov_ps(ok, _mm512_scalef_ps(p, n));
  }
  static float hmax(R v) { return _mm512_reduce_max_ps(v); }
  static float hsum(R v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(KVRELAY_AVX2)
struct Vf {
  using R = __m256;
  static constexpr int W = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R keep_le(R a, R x, R y) { return _mm256_blendv_ps(set1(-INFINITY), a, _mm256_cmp_ps(x, y, _CMP_LE_OQ)); }
  static R keep_gt(R a, R x, R y) { return _mm256_blendv_ps(set1(-INFINITY), a, _mm256_cmp_ps(x, y, _CMP_GT_OQ)); }
  static R select_if_neg_inf(R x, R when_inf) {
    return _mm256_blendv_ps(x, when_inf, _mm256_cmp_ps(x, set1(-INFINITY), _CMP_EQ_OQ));
  }
  static R exp_neg(R x) { return kvrelay::exp_neg(x); }
  static float hmax(R v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static float hsum(R v) { return hsum8(v); }
};
#endif

#if defined(KVRELAY_AVX512)
// exp for any x, as exp_ps (common.h) for 8 lanes: 0 below -87.3, +inf above 88.3, within 1 ulp of expf between.
inline __m512 exp16(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.3f), _CMP_GT_OQ);
  const __m512 e = Vf::exp_neg(_mm512_min_ps(x, _mm512_set1_ps(88.3f)));  // exp_neg's core serves any x <= 88.3
  return _mm512_mask_blend_ps(over, _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), e), _mm512_set1_ps(INFINITY));
}

// fp32 lanes rounded to bf16 precision (nearest even, as torch rounds), kept as fp32; NaN stays NaN.
inline __m512i bf16_bits_rne16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(b, _mm512_set1_epi32(0x400000)));
}
inline __m512 round_bf16_16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits_rne16(x), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits_rne16(v), 16)));
}
// Only the lanes of `mask` (a row's last, partial group of 16).
inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits_rne16(v), 16)));
}
// A value as the dtype T holds it (bf16 rounds), kept in fp32.
template <typename T>
inline __m512 round_to16(__m512 v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else return round_bf16_16(v);
}

// 16 lanes of fp32 from fp32 or bf16 memory (bf16 widened exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const Fp8* p) {  // as load8(const Fp8*) (common.h), 16 lanes
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
// From offset c (a multiple of 16) of a row (after every one-pointer load16: the template finds them).
template <typename T>
inline __m512 load16(const T* row, int64_t c) { return load16(row + c); }
inline __m512 load16(const Q8* row, int64_t c) {  // as load8(const Q8*, c) (common.h), 16 lanes
  const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(x), _mm512_set1_ps(q8_scale(row, c)));
}

// v[i] = sum of the 16 lanes of a[i], for 16 vectors at once (a transposing tree of adds: 37 operations where
// 16 separate reductions take ~160).
inline __m512 hsum16x16(__m512 a[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // c[i], 128-bit lane L: the sums over lane L of a[4i..4i+3]; add the four lanes of each.
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}
#endif

#if defined(KVRELAY_AVX2) && !defined(KVRELAY_AVX512)
// v[i] = sum of the 8 lanes of a[i], for 8 vectors at once (the 8-lane counterpart of hsum16x16).
inline __m256 hsum8x8(__m256 a[8]) {
  // After two rounds of pairwise adds, each 128-bit half holds sums over that half of four vectors' lanes.
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

// W lanes of fp32 from offset c of a row of fp32, bf16, fp8 or int8 memory, and W vectors' lane sums at once, at the machine's width.
#if defined(KVRELAY_AVX512)
template <typename T>
inline Vf::R load_w(const T* p) { return load16(p); }
template <typename T>
inline Vf::R load_w(const T* row, int64_t c) { return load16(row, c); }
inline Vf::R hsum_wxw(Vf::R a[Vf::W]) { return hsum16x16(a); }
#elif defined(KVRELAY_AVX2)
template <typename T>
inline Vf::R load_w(const T* p) { return load8(p); }
template <typename T>
inline Vf::R load_w(const T* row, int64_t c) { return load8(row, c); }
inline Vf::R hsum_wxw(Vf::R a[Vf::W]) { return hsum8x8(a); }
#endif

#if defined(KVRELAY_AVX512BF16)
// Pairs of bf16 in one 32-bit lane: (lo, hi). dot_pairs(acc, a, b) adds a.lo * b.lo + a.hi * b.hi per lane, the
// products exact and the sums in fp32.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}
// bf16(x) in the low and bf16(y) in the high half of each lane (rounded to nearest even).
inline __m512i pack_pairs(__m512 x, __m512 y) {
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(y, x));  // x in 0..15, y in 16..31
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, both);
}
// Lanes i of a and b (16-bit elements) interleaved: pairs (a[i], b[i]) for i in [16 half, 16 half + 16).
inline __m512i interleave_pairs(__m512i a, __m512i b, int half) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                             38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  return _mm512_permutex2var_epi16(a, half ? hi : lo, b);
}
// 32 fp8 e4m3 numbers as bf16, exactly (every e4m3 number is a bf16 number), in integer operations: a normal
// number's 7 magnitude bits shifted into bf16's exponent and mantissa fields, plus 120 on the exponent (bias 127
// against e4m3's 7); a subnormal's (exponent 0: m 2^-9) from a table; then the sign. (The NaN codes, which the
// cache's writes never make, read as 480, as load16 reads them.) 8 operations where widening through fp32 takes 11.
inline __m512i fp8x32_as_bf16(const Fp8* p) {
  const __m512i subnormals = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              0, 0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
  const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
  __m512i y = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  y = _mm512_mask_permutexvar_epi16(y, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, subnormals);
  return _mm512_or_si512(y, _mm512_and_si512(x, _mm512_set1_epi16(static_cast<short>(0x8000))));
}
// A row of n fp8 e4m3 numbers (n a multiple of 32) as bf16. An fp8 cache then computes in bf16 pairs as a bf16
// cache does.
inline void fp8_row_as_bf16(const Fp8* src, int64_t n, uint16_t* dst) {
  for (int64_t e = 0; e < n; e += 32) _mm512_storeu_si512(dst + e, fp8x32_as_bf16(src + e));
}
// Zeros to read in place of a value row past the end of a chunk (head sizes up to 256).
alignas(64) inline constexpr uint16_t kZeroRow[256] = {};
// One row of a P V product's B tiles: dims [0, n) of value rows x and y (16-bit elements, n a multiple of 32) as
// pairs, dst[e] = (x[e], y[e]). Row j of the tiles takes keys 2j and 2j + 1; every kernel staging values for
// AVX512-BF16 dot products or AMX tiles writes them through here.
inline void store_pair_row(const void* x, const void* y, int64_t n, uint32_t* dst) {
  const uint16_t* xs = static_cast<const uint16_t*>(x);
  const uint16_t* ys = static_cast<const uint16_t*>(y);
  for (int64_t e = 0; e < n; e += 32) {
    const __m512i xv = _mm512_loadu_si512(xs + e), yv = _mm512_loadu_si512(ys + e);
    _mm512_storeu_si512(dst + e, interleave_pairs(xv, yv, 0));
    _mm512_storeu_si512(dst + e + 16, interleave_pairs(xv, yv, 1));
  }
}
// silu(gate) * up for 16 columns of fp32 sums, each first rounded to bf16 as a projection's output is, with
// silu_mul's arithmetic to the bit (fused_ops.cpp, which compiles it without FMA contraction).
void silu_mul_sums16(const float* gate, const float* up, at::BFloat16* out);
#endif

}  // namespace kvrelay
