// The GGUF GEMM for a batch of x rows (a batched decode step, a short prefill chunk) with AVX512-VNNI: x's rows
// are the vector's 16 lanes, and one weight block meets 16 rows at once. It runs the K-quants; Q4_0, Q4_1 and Q8_0
// run on the wide kernel (gguf_wide.h), which turns this one around and is faster for them.
//
// The row-at-a-time tile (gguf_gemm.cpp) spends four more instructions per block and row than the dot product
// itself (its int32 sums' conversion, the scale's product and broadcast, the accumulation), and 256-bit dot
// products: fine for a decode's one row, 3.5x the time of the dense bf16 GEMM on a 32- to 64-row batch
// (docs/quantization.md). Here x is quantized as before (int8 per block of 32, gguf_xquant.h) and repacked so
// that each 64-byte vector holds one 4-byte group of a block for 16 rows; a block's 32 weights are unpacked once,
// each 4-byte group broadcast, and 8 vpdpbusd give the exact int32 block sums of 16 rows. Converting, scaling
// and accumulating then costs one instruction each per block for all 16 rows.
//
// The K-quants' sub-blocks of 32 are blocks here with their own d and lo (Q4_K, Q5_K: d sc_j and -dmin m_j); Q6_K's
// halves of 16 have scales of their own, so its groups sum in two integers, each times its scale.
//
// A row's result is sum over blocks b, in order, of float(int32 sum) * (d_b * dx_b) + lo_b * sx_b: it depends on
// its own x row only, so it is the same in any batch this kernel runs; it is not the bits of the row-at-a-time
// tile, whose float sums split each block in 8 lanes (a step switches kernels at kLaneRows, gguf_gemm).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVRELAY_GGUF_LANES 1

namespace kvrelay::gguf_lanes {

constexpr int kLanes = 16;   // x rows per vector
constexpr int kGroups = 8;   // 4-byte groups in a block of 32
constexpr int kRows = 4;     // weight rows one pass takes: each x vector loaded serves them all
constexpr int kMaxJ = 2;     // row blocks (of 16) one pass keeps in registers (kRows x kMaxJ sums of each kind)

// x's int8 rows, their block scales dx and dx * sum(xq) (gguf_xquant.h's quantize_row, row-major), repacked:
// xp[((j * B + b) * 8 + g) * 64 + lane * 4 + t] = xq[16 j + lane][32 b + 4 g + t] + 128 (unsigned: vpdpbusd's
// unsigned side, so that the weights, on its signed side, can be broadcast from memory as they are), and
// dxp / sxp[(j * B + b) * 16 + lane]; rows past M are zero.
struct Packed {
  std::vector<int8_t> xp;
  std::vector<float> dxp, sxp;
  int64_t blocks_of_rows = 0;  // J: ceil(M / 16)

  void pack(const int8_t* xq, const float* dx, const float* sx, int64_t M, int64_t K) {
    const int64_t B = K / 32;
    blocks_of_rows = (M + kLanes - 1) / kLanes;
    xp.assign(blocks_of_rows * kLanes * K, 0);
    dxp.assign(blocks_of_rows * B * kLanes, 0.f);
    sxp.assign(blocks_of_rows * B * kLanes, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      const int64_t j = m / kLanes, lane = m % kLanes;
      const uint32_t* row = reinterpret_cast<const uint32_t*>(xq + m * K);
      uint32_t* dst = reinterpret_cast<uint32_t*>(xp.data()) + j * B * kGroups * kLanes + lane;
      for (int64_t u = 0; u < K / 4; ++u) dst[u * kLanes] = row[u] ^ 0x80808080u;  // group u = 8 b + g; + 128
      for (int64_t b = 0; b < B; ++b) {
        dxp[(j * B + b) * kLanes + lane] = dx[m * B + b];
        sxp[(j * B + b) * kLanes + lane] = sx[m * B + b];
      }
    }
  }
};

// What unpacking a block of 32 weights gives besides its values: they stand for d q + lo; qs is the sum of the 32
// (x + 128 meets them: 128 qs comes off). A type whose halves of 16 have scales of their own (Q6_K) gives sc and
// sc_hi with the halves' sums qs and qs_hi, and the block's integer sum is sc (its first half's) + sc_hi (its
// second's).
struct Sub {
  float d = 0.f, lo = 0.f;
  int32_t qs = 0, qs_hi = 0, sc = 1, sc_hi = 1;
};

// NW weight rows (from wrow, row_bytes apart; B blocks of bsz bytes) against row blocks [j0, j0 + JB): out[w][j]
// [lane] for weight row w and x row 16 (j0 + j) + lane. Each x vector loaded serves NW weight rows.
// `unpack(wrow, b, q, sub)` puts block b's 32 values in q (int8, in order) and the rest in sub; Unpack::kHalves
// says whether its halves have scales of their own.
template <int NW, int JB, class Unpack>
inline void tile(const uint8_t* wrow, int64_t row_bytes, int64_t B, int64_t bsz, const Packed& x, int64_t j0,
                 Unpack&& unpack, float (*out)[kMaxJ][kLanes]) {
  __m512 f[NW][JB];
  for (int r = 0; r < NW; ++r)
    for (int j = 0; j < JB; ++j) f[r][j] = _mm512_setzero_ps();
  constexpr bool halves = std::decay_t<Unpack>::kHalves;
  alignas(64) int32_t q[NW][kGroups];
  Sub sub[NW];
  const uint8_t* xp = reinterpret_cast<const uint8_t*>(x.xp.data());
  for (int64_t b = 0; b < B; ++b) {
    for (int r = 0; r < NW; ++r)
      unpack(wrow + r * row_bytes, b, bsz, reinterpret_cast<uint8_t*>(q[r]), sub[r]);
    // Each group of weights is broadcast from memory into its vpdpbusd ({1to16}), not shuffled out of a register.
    asm volatile("" : : "r"(q) : "memory");
    __m512i acc[NW][JB], acc_hi[NW][JB];  // acc_hi: the second half's groups, for a type with halves
    for (int r = 0; r < NW; ++r)
      for (int j = 0; j < JB; ++j) acc[r][j] = acc_hi[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < kGroups; ++g) {
      for (int j = 0; j < JB; ++j) {
        const __m512i v = _mm512_loadu_si512(xp + (((j0 + j) * B + b) * kGroups + g) * 64);
        for (int r = 0; r < NW; ++r) {
          __m512i& a = halves && g >= kGroups / 2 ? acc_hi[r][j] : acc[r][j];
          a = _mm512_dpbusd_epi32(a, v, _mm512_set1_epi32(q[r][g]));
        }
      }
    }
    for (int j = 0; j < JB; ++j) {
      const int64_t at = ((j0 + j) * B + b) * kLanes;
      const __m512 dxv = _mm512_loadu_ps(x.dxp.data() + at), sxv = _mm512_loadu_ps(x.sxp.data() + at);
      for (int r = 0; r < NW; ++r) {
        const Sub& w = sub[r];
        __m512i exact = _mm512_sub_epi32(acc[r][j], _mm512_set1_epi32(128 * w.qs));  // x was + 128
        if constexpr (halves)
          exact = _mm512_add_epi32(
              _mm512_mullo_epi32(exact, _mm512_set1_epi32(w.sc)),
              _mm512_mullo_epi32(_mm512_sub_epi32(acc_hi[r][j], _mm512_set1_epi32(128 * w.qs_hi)),
                                 _mm512_set1_epi32(w.sc_hi)));
        f[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(_mm512_set1_ps(w.d), dxv), f[r][j]);
        if (w.lo != 0.f) f[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(w.lo), sxv, f[r][j]);
      }
    }
  }
  for (int r = 0; r < NW; ++r)
    for (int j = 0; j < JB; ++j) _mm512_storeu_ps(out[r][j], f[r][j]);
}

// tile<NW, JB> for run-time nw <= kRows and jb <= kMaxJ.
template <int NW, int JB = kMaxJ, class Unpack>
inline void tile_any(int nw, int jb, const uint8_t* wrow, int64_t row_bytes, int64_t B, int64_t bsz,
                     const Packed& x, int64_t j0, Unpack&& unpack, float (*out)[kMaxJ][kLanes]) {
  if constexpr (NW > 1) {
    if (nw < NW) return tile_any<NW - 1, JB>(nw, jb, wrow, row_bytes, B, bsz, x, j0, unpack, out);
  }
  if constexpr (JB > 1) {
    if (jb < JB) return tile_any<NW, JB - 1>(nw, jb, wrow, row_bytes, B, bsz, x, j0, unpack, out);
  }
  tile<NW, JB>(wrow, row_bytes, B, bsz, x, j0, unpack, out);
}

// Weight rows [n0, n1) against every row block: store(row, n, value) for rows < M.
template <class Unpack, class Store>
void rows(const uint8_t* wp, int64_t row_bytes, int64_t n0, int64_t n1, int64_t B, int64_t bsz, const Packed& x,
          int64_t M, Unpack&& unpack, Store&& store) {
  float out[kRows][kMaxJ][kLanes];
  const int64_t J = x.blocks_of_rows;
  for (int64_t n = n0; n < n1; n += kRows) {
    const int nw = static_cast<int>(std::min<int64_t>(kRows, n1 - n));
    for (int64_t j0 = 0; j0 < J; j0 += kMaxJ) {
      const int jb = static_cast<int>(std::min<int64_t>(kMaxJ, J - j0));
      tile_any<kRows>(nw, jb, wp + n * row_bytes, row_bytes, B, bsz, x, j0, unpack, out);
      for (int r = 0; r < nw; ++r)
        for (int j = 0; j < jb; ++j)
          for (int lane = 0; lane < kLanes; ++lane) {
            const int64_t m = (j0 + j) * kLanes + lane;
            if (m < M) store(m, n + r, out[r][j][lane]);
          }
    }
  }
}

}  // namespace kvrelay::gguf_lanes
#endif
