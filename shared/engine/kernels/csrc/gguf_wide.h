// The GGUF GEMM for Q4_0, Q4_1 and Q8_0 with AVX512-VNNI from 8 rows of x (gguf_gemm.cpp's kLaneRows), prefill
// chunks of any length included: the weights' output rows are the vector's 16 lanes ("wide"), x's groups of 4
// int8 values the broadcast operand.
//
// The lanes kernel (gguf_lanes.h) puts x's rows in the lanes and broadcasts weights, so x, which is signed, sits on
// vpdpbusd's unsigned side (+ 128) and every block pays for the weights' sum that takes it off again, besides its
// unpacking per weight row. Here a 4-bit weight (0..15) is vpdpbusd's unsigned operand as it is (Q8_0's + 128,
// taken off as its minimum) and x its signed one, broadcast from memory. A block of 16 output rows is put once per
// call into the instruction's layout (16 rows' bytes transposed in 4-byte groups: for Q4 each gives two groups,
// low and high nibbles); then each x row costs 8 vpdpbusd and three float instructions per block: convert, d dx,
// accumulate (and lo sx for the block's minimum).
//
// For Q4, each result is the lanes kernel's to the bit: per block b in order, float(int32 sum) * (d_b dx_b) then
// + lo_b sx_b, both fused multiply-adds; Q4_0's lo is -8 d.
//
// What it bought, measured: docs/quantization.md. Asking for the next tile's bytes ahead (software prefetch) did
// not speed up weights streamed from memory (8 rows: 9.07 against 9.0-9.7 ms for 30 layers), so it is not done.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KVRELAY_GGUF_WIDE 1

namespace kvrelay::gguf_wide {

constexpr int kCols = 16;  // output rows (of W) per vector
constexpr int kRows = 12;  // x rows per pass: their sums, the block's 8 weight vectors and its scales in registers

// 16 bytes at `at` of each of 16 rows, transposed in 4-byte groups: g[k] holds bytes 4k..4k+3 of the 16 rows
// (faster than a gather per group on a Zen 4). z[i] holds rows i, 4 + i, 8 + i, 12 + i in its 128-bit lanes, so
// that after two rounds of unpacking, lane 4 l + i of each group vector is row 4 l + i.
inline void transpose16(const uint8_t* const* row, int64_t at, __m512i* g) {
  __m512i z[4];
  const auto load = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + at)); };
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(load(i)), load(4 + i), 1),
                                                 load(8 + i), 2), load(12 + i), 3);
  const __m512i a = _mm512_unpacklo_epi32(z[0], z[1]), c = _mm512_unpacklo_epi32(z[2], z[3]);
  const __m512i e = _mm512_unpackhi_epi32(z[0], z[1]), f = _mm512_unpackhi_epi32(z[2], z[3]);
  g[0] = _mm512_unpacklo_epi64(a, c);
  g[1] = _mm512_unpackhi_epi64(a, c);
  g[2] = _mm512_unpacklo_epi64(e, f);
  g[3] = _mm512_unpackhi_epi64(e, f);
}

// Output rows [n0, n0 + 16) of W in vpdpbusd's layout: q[b * 8 + g] holds group g (values 4g..4g+3) of block b
// for the 16 rows as unsigned bytes, d[b] and lo[b] their scales and what a value of 0 stands for: each weight is
// d u + lo with u the unsigned byte (Q4_1: u = q, lo = m; Q4_0: u = q, lo = -8 d; Q8_0: u = q + 128, lo = -128 d).
// Rows past the matrix repeat its last one. T: ggml's type number (2 Q4_0, 3 Q4_1, 8 Q8_0).
struct Tile {
  std::vector<__m512i> q;
  std::vector<__m512> d, lo;

  template <int64_t T>
  void gather(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t B) {
    constexpr int64_t bsz = T == 3 ? 20 : T == 2 ? 18 : 34, qoff = T == 3 ? 4 : 2;
    q.resize(B * 8);
    d.resize(B);
    lo.resize(B);
    alignas(64) int32_t offsets[kCols];
    const uint8_t* row[kCols];
    for (int c = 0; c < kCols; ++c) {
      offsets[c] = static_cast<int32_t>(std::min<int64_t>(c, rows - 1) * row_bytes);
      row[c] = w + offsets[c] + qoff;
    }
    const __m512i off = _mm512_load_si512(offsets), nibble = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(-128);
    for (int64_t b = 0; b < B; ++b) {
      // d (and Q4_1's minimum m) are the block's first two (four) bytes: one fp16 in each half of a 32-bit lane.
      const __m512i head = _mm512_i32gather_epi32(off, w + b * bsz, 1);
      d[b] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
      lo[b] = T == 3 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                     : _mm512_mul_ps(d[b], _mm512_set1_ps(T == 2 ? -8.f : -128.f));
      __m512i g[4];
      transpose16(row, b * bsz, g);
      if constexpr (T == 8) {  // 32 signed bytes in order, + 128
        for (int k = 0; k < 4; ++k) q[b * 8 + k] = _mm512_xor_si512(g[k], flip);
        transpose16(row, b * bsz + 16, g);
        for (int k = 0; k < 4; ++k) q[b * 8 + 4 + k] = _mm512_xor_si512(g[k], flip);
      } else {  // byte j of the 16 holds value j (low nibble) and value j + 16 (high): groups k and k + 4
        for (int k = 0; k < 4; ++k) {
          q[b * 8 + k] = _mm512_and_si512(g[k], nibble);
          q[b * 8 + k + 4] = _mm512_and_si512(_mm512_srli_epi32(g[k], 4), nibble);
        }
      }
    }
  }
};

// acc += w (unsigned bytes) . the 4 signed bytes at x in every lane, x broadcast by the instruction itself from
// memory: GCC emits a separate vpbroadcastd for _mm512_set1_epi32(*x), a second vector instruction per vpdpbusd.
inline void dpbusd_bcast(__m512i& acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
}

// R rows of x (xq row-major [.., K] int8 from row m0; dx, sx [.., B]) against the tile: out[r] = the 16 results.
template <int R>
inline void rows(const Tile& t, const int8_t* xq, const float* dx, const float* sx, int64_t m0, int64_t K,
                 int64_t B, __m512* out) {
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i w[8];
    for (int g = 0; g < 8; ++g) w[g] = t.q[b * 8 + g];
    const __m512 d = t.d[b], lo = t.lo[b];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int32_t* x = reinterpret_cast<const int32_t*>(xq + (m0 + r) * K + b * 32);
      __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) dpbusd_bcast(acc, w[g], x + g);
      const int64_t at = (m0 + r) * B + b;
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d, _mm512_set1_ps(dx[at])), f[r]);
      f[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(sx[at]), f[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = f[r];
}

template <int R = kRows>
inline void rows_any(int r, const Tile& t, const int8_t* xq, const float* dx, const float* sx, int64_t m0,
                     int64_t K, int64_t B, __m512* out) {
  if constexpr (R > 1) {
    if (r < R) return rows_any<R - 1>(r, t, xq, dx, sx, m0, K, B, out);
  }
  rows<R>(t, xq, dx, sx, m0, K, B, out);
}

// Output rows [n0, n1) (a multiple of 16 apart, but for the matrix's last tile) for every row of x:
// store(m, n0 of the tile, valid columns, the 16 results) for each x row m.
template <int64_t T, class Store>
void gemm(const uint8_t* wp, int64_t row_bytes, int64_t N, int64_t n0, int64_t n1, int64_t B, const int8_t* xq,
          const float* dx, const float* sx, int64_t M, Store&& store) {
  const int64_t K = B * 32;
  Tile t;
  __m512 out[kRows];
  for (int64_t n = n0; n < n1; n += kCols) {
    const int64_t cols = std::min<int64_t>(kCols, N - n);
    t.gather<T>(wp + n * row_bytes, row_bytes, cols, B);
    for (int64_t m = 0; m < M; m += kRows) {
      const int r = static_cast<int>(std::min<int64_t>(kRows, M - m));
      rows_any(r, t, xq, dx, sx, m, K, B, out);
      for (int i = 0; i < r; ++i) store(m + i, n, static_cast<int>(cols), out[i]);
    }
  }
}

}  // namespace kvrelay::gguf_wide
#endif
