// GGUF's K-quants (super-blocks of 256 weights) for gguf_gemm.cpp: Q4_K, Q5_K and Q6_K, as ggml lays them out
// (ggml-common.h; the gguf package's dequantize_blocks reads the same bytes):
//   Q4_K  144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
//         4-bit q; sub-block j is the low (j even) or high (j odd) nibbles of bytes 32 (j / 2) .. +32;
//         w = (d sc_j) q - (dmin m_j)
//   Q5_K  176 bytes: as Q4_K, then 32 bytes of fifth bits (bit j of byte l is sub-block j's element l), then q
//   Q6_K  210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 weights), fp16 d;
//         w = d sc (q - 32)
// Every sub-block of 32 meets one block of the int8 activations, so a dot product is an integer one per
// sub-block, as for the 32-weight types: Q4_K and Q5_K are Q4_1 with scale d sc_j and minimum -dmin m_j; Q6_K
// weighs its two halves' int16 pair sums by their scales in one madd.
#pragma once

#include <cstdint>
#include <cstring>

namespace kquants {

constexpr int kSuper = 256;
enum KType : int64_t { kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };  // ggml's type numbers

constexpr bool is_kquant(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }

inline int64_t super_bytes(int64_t t) { return t == kQ4_K ? 144 : t == kQ5_K ? 176 : 210; }

// The 8 sub-blocks' 6-bit scales (bytes 0..7 of `out`) and mins (bytes 8..15) from a Q4_K/Q5_K super-block's 12
// packed bytes `s`, all at once (ggml's unpacking: get_scale_min_k4 for every j).
inline void scales_and_mins(const uint8_t* s, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_low = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_low;
  u[0] &= m1;
  std::memcpy(out, u, 16);
}

// Sub-block j's 6-bit scale and min alone (ggml's get_scale_min_k4): what scales_and_mins gives at j and 8 + j.
inline void scale_min(const uint8_t* s, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Element l (0..31) of 32-weight sub-block j of super-block `sb`, as an integer: 0..15 (Q4_K), 0..31 (Q5_K), or
// -32..31 (Q6_K).
inline int q_at(const uint8_t* sb, int64_t t, int j, int l) {
  if (t == kQ6_K) {
    const int h = j / 4, jj = j % 4;
    const int lo = (sb[h * 64 + (jj % 2) * 32 + l] >> (4 * (jj / 2))) & 0x0F;
    const int hi = (sb[128 + h * 32 + l] >> (2 * jj)) & 0x03;
    return (lo | (hi << 4)) - 32;
  }
  const uint8_t* qs = sb + (t == kQ4_K ? 16 : 48);
  int q = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
  if (t == kQ5_K) q |= ((sb[16 + l] >> j) & 1) << 4;
  return q;
}

}  // namespace kquants
