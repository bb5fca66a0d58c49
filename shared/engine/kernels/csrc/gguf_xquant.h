// x's side of the GGUF GEMM (gguf_gemm.cpp): each row quantized per block of 32 to int8 with a scale, as llama.cpp
// quantizes activations for its integer dot products (scale max|x| / 127, each value rounded half away from zero,
// as lround does). Vectorised where the CPU has AVX2, with the same result to the bit as the scalar loop.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "common.h"
#include "vec.h"

namespace kvrelay::gguf_x {

constexpr int kBlock = 32;

#if defined(KVRELAY_AVX512)
// One row of x (fp32 or bf16, read in place: vec.h's load16) quantized per block, 16 lanes at a time: the AVX2
// loop's arithmetic, so the same bytes and scales (a max and an integer sum do not depend on their order).
template <typename T>
inline void quantize_row16(const T* x, int64_t K, int8_t* xq, float* dx, float* sx) {
  const __m512 sign = _mm512_set1_ps(-0.f), one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 v[2] = {load16(x + b * kBlock), load16(x + b * kBlock + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v[0]), _mm512_andnot_ps(sign, v[1])));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    __m512i q[2];
    for (int i = 0; i < 2; ++i) {
      const __m512 s = _mm512_mul_ps(v[i], _mm512_set1_ps(id));
      const __m512 t = _mm512_roundscale_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, _mm512_sub_ps(s, t)), half, _CMP_GE_OQ);
      q[i] = _mm512_cvtps_epi32(_mm512_mask_add_ps(t, up, t, _mm512_or_ps(_mm512_and_ps(s, sign), one)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16 * i), _mm512_cvtepi32_epi8(q[i]));
    }
    dx[b] = d;
    sx[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1])));
  }
}
#endif

// One row of x quantized per block: xq[K] int8, dx[B] (its scale), sx[B] (dx * sum of the block's xq).
inline void quantize_row(const float* x, int64_t K, int8_t* xq, float* dx, float* sx) {
#if defined(KVRELAY_AVX2)
  // 8 lanes at a time, each value rounded half away from zero as lround does (the scalar loop below).
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f), half = _mm256_set1_ps(0.5f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 s = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
      const __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(s, t)), half, _CMP_GE_OQ);
      q[i] = _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(s, sign), one))));
    }
    // packs interleave the 128-bit lanes: 4-byte groups q0a q1a q2a q3a | q0b q1b q2b q3b, put back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    dx[b] = d;
    sx[b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
#else
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int q = static_cast<int>(std::lround(xb[i] * id));
      xq[b * kBlock + i] = static_cast<int8_t>(q);
      sum += q;
    }
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
  }
#endif
}


// One row of x, fp32 or bf16 (what gguf_gemm calls): with AVX512, 16 lanes at a time, bf16 widened in registers;
// else bf16 is widened into `buf` first.
template <typename T>
inline void quantize(const T* x, int64_t K, int8_t* xq, float* dx, float* sx, std::vector<float>& buf) {
#if defined(KVRELAY_AVX512)
  (void)buf;
  quantize_row16(x, K, xq, dx, sx);
#else
  if constexpr (!std::is_same_v<T, float>) buf.resize(K);
  quantize_row(as_f32(x, buf.data(), K), K, xq, dx, sx);
#endif
}

}  // namespace kvrelay::gguf_x
