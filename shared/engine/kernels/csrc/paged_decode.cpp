// Paged attention for single-token decodes on CPU, reading keys and values in place from the block table
// (no gather copy). One work item = one request (or, with fewer requests than threads, one of its kv heads):
// the query heads sharing a kv head use every K/V row it loads, so the KV cache is read exactly once.
// Scores, softmax and accumulation in fp32; queries and the cache may each be fp32 or bf16.
//
// Two implementations: `decode_heads_w`, written once against the machine's vector (vec.h: 16 lanes with AVX512,
// 8 with AVX2) for head size 64 (and 128 with AVX512): W keys' dot products reduced together by one transposing
// tree, and with AVX512-BF16, bf16 queries and a bf16 or fp8 cache, dot products of bf16 pairs in hardware
// (q . k exact products, fp32 sums; p . v with each weight split into two bf16 parts, p = hi + lo); and
// `decode_heads` (8-lane AVX2 or scalar) for any other head size. With AMX, a bf16 cache and queries (head size 64
// or 128, block size a multiple of 16) run on the tile units instead (paged_decode_amx.cpp).
#pragma GCC optimize("fp-contract=fast")  // FMAs in the dot products: speed over bit-exactness here

#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "common.h"
#include "vec.h"
#ifndef KV_PF_DIST
#define KV_PF_DIST 32  // rows prefetched ahead of use: 16 measured 10-15% slower, 64 no better
#endif

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
      const T* vr = v + t * v_stride;
      const __m256 a = load8(vr, c), b = load8(vr, c + 8);
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

#if defined(KVRELAY_AVX512) || defined(KVRELAY_AVX2)
// Softmax in place of one row of scores padded to a multiple of W with -inf (which come out 0).
inline void softmax_row_w(float* s, int64_t npad) {
  using R = Vf::R;
  R mx = Vf::set1(-INFINITY);
  for (int64_t j = 0; j < npad; j += Vf::W) mx = Vf::max(mx, Vf::load(s + j));
  const R m = Vf::set1(Vf::hmax(mx));
  R sum = Vf::zero();
  for (int64_t j = 0; j < npad; j += Vf::W) {
    const R e = Vf::exp_neg(Vf::sub(Vf::load(s + j), m));
    Vf::store(s + j, e);
    sum = Vf::add(sum, e);
  }
  const R inv = Vf::set1(1.f / Vf::hsum(sum));
  for (int64_t j = 0; j < npad; j += Vf::W) Vf::store(s + j, Vf::mul(Vf::load(s + j), inv));
}

// q . k for W keys: fp32 query row against fp32 or bf16 keys (widened), reduced together.
template <int D, typename T>
inline Vf::R scores_w(const float* q, const T* const* k) {
  Vf::R acc[Vf::W];
  for (int i = 0; i < Vf::W; ++i) acc[i] = Vf::zero();
#pragma GCC unroll 8
  for (int c = 0; c < D; c += Vf::W) {
    const Vf::R qv = Vf::load(q + c);
    for (int i = 0; i < Vf::W; ++i) acc[i] = Vf::fma(qv, load_w(k[i], c), acc[i]);
  }
  return hsum_wxw(acc);
}

#if defined(KVRELAY_AVX512BF16)
// 32 numbers of a bf16 or fp8 row from offset c as bf16 (fp8 widened exactly, in registers).
inline __m512i bf16x32(const at::BFloat16* row, int64_t c) { return _mm512_loadu_si512(row + c); }
inline __m512i bf16x32(const Fp8* row, int64_t c) { return fp8x32_as_bf16(row + c); }

template <int D, typename T>
inline __m512 scores_w(const at::BFloat16* q, const T* const* k) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < D; c += 32) {
    const __m512i qv = _mm512_loadu_si512(q + c);
    for (int i = 0; i < 16; ++i) acc[i] = dot_pairs(acc[i], bf16x32(k[i], c), qv);
  }
  return hsum16x16(acc);
}
#endif

// Prefetches the rows an item reads in the order it reads them (the keys of each of its kv heads, then the
// values of each), so the stream runs on from one walk into the next instead of starting cold at each walk.
template <typename T, typename Q>
class WalkAhead {
 public:
  WalkAhead(const AttnView<T, Q>& a, const int32_t* table, int64_t first, int64_t seq_len, int64_t h0, int64_t nh)
      : a_(a), table_(table), first_(first), n_(seq_len - first), h0_(h0), nh_(nh),
        cur_(a.rows(a.k, table, first, h0)) {}
  void advance(int64_t rows) {
    for (; rows > 0 && walk_ < 2 * nh_; --rows) {
      prefetch(cur_.next(), a_.d * int64_t(sizeof(T)));
      if (++done_ < n_) continue;
      done_ = 0;
      if (++walk_ < 2 * nh_) cur_ = a_.rows(walk_ < nh_ ? a_.k : a_.v, table_, first_, h0_ + walk_ % nh_);
    }
  }

 private:
  const AttnView<T, Q>& a_;
  const int32_t* table_;
  int64_t first_, n_, h0_, nh_, walk_ = 0, done_ = 0;  // walks 0..nh-1: keys of head h0 + walk; then values
  RowCursor<T> cur_;
};

// Decode for kv heads [h0, h0 + nh) of one request, W lanes at a time. Pairs mode (bf16 queries and a bf16 or fp8
// cache on a CPU with AVX512-BF16; fp8 rows widened to bf16 exactly in registers): the queries stay bf16, and
// p . v takes each weight as hi + lo, two bf16 numbers (16 bits of it, not 8). Rounding p to bf16 alone, as GPU flash attention does, made the output's error 1.3-1.4x that of
// rounding the exact result to bf16; the split makes it equal, and whole runs measured level (docs/results/2026-11-27-zen4/NOTES.md).
// Each kv head walks its keys, then its values, on its own; one WalkAhead prefetches KV_PF_DIST rows ahead
// across all of the item's walks (32 x 600 tokens fp32: 5% faster than restarting at each walk). (Walking a chunk
// of 16 tokens for all the item's heads at once, reading each block's rows front to back, measured 20-25%
// slower on an AVX512-BF16 EPYC, whatever the prefetch distance or hint.)
template <typename T, typename Q, int D>
void decode_heads_w(const AttnView<T, Q>& a, const int32_t* table, int64_t token, int64_t seq_len,
                      int64_t first, int64_t h0, int64_t nh, Scratch& s) {
#if defined(KVRELAY_AVX512BF16)
  constexpr bool pairs = (std::is_same<T, at::BFloat16>::value || std::is_same<T, Fp8>::value) &&
                         std::is_same<Q, at::BFloat16>::value;
#else
  constexpr bool pairs = false;
#endif
  using QRow = typename std::conditional<pairs, Q, float>::type;
  constexpr int W = Vf::W;
  const int64_t group = a.group(), rows = nh * group, n = seq_len - first, npad = (n + W - 1) / W * W;
  const Q* q = a.q + token * a.q_stride + h0 * group * D;
  const QRow* qrows;
  if constexpr (pairs) qrows = q;
  else qrows = as_f32_n(q, s.floats(1, rows * D), rows * D);
  float* scores = s.floats(0, rows * npad);
  // Pass 1: scores, W keys at a time (the last group padded with its last key; those lanes are set to -inf).
  const T* kp[W];
  WalkAhead<T, Q> ahead(a, table, first, seq_len, h0, nh);
  ahead.advance(KV_PF_DIST);
  for (int64_t hh = 0; hh < nh; ++hh) {
    RowCursor<T> keys = a.rows(a.k, table, first, h0 + hh);
    for (int64_t t0 = first; t0 < seq_len; t0 += W) {
      const int64_t cnt = std::min<int64_t>(W, seq_len - t0);
      for (int64_t i = 0; i < cnt; ++i) kp[i] = keys.next();
      for (int64_t i = cnt; i < W; ++i) kp[i] = kp[cnt - 1];
      ahead.advance(cnt);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = hh * group + g;
        Vf::store(scores + row * npad + (t0 - first), Vf::mul(scores_w<D>(qrows + row * D, kp), Vf::set1(a.scale)));
      }
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    std::fill(scores + row * npad + n, scores + (row + 1) * npad, -INFINITY);
    softmax_row_w(scores + row * npad, npad);
  }
  // Pass 2: out = sum_t p_t v_t, up to GT query rows of a kv head per walk over its values, their GT x C sums
  // in registers (32 of them with AVX512; AVX2's 16 hold one row of 64). AVX2 holding 3 rows x half a head
  // instead (a third of the loads) was 10% faster with prefetches into L2, but 8-14% slower in fp32 where they
  // fill L1, as on every AVX2-only machine (csrc/common.h): AVX2-held Zen 4, 32 and 64 decodes x 600 tokens,
  // builds alternated in one process (docs/results/2026-11-28-zen4-avx2emu-t0/NOTES.md).
  constexpr int GT = W == 16 ? (D <= 64 ? 3 : 2) : 1;
  constexpr int C = D / W;
  [[maybe_unused]] const uint32_t* pw = nullptr;
  [[maybe_unused]] const int64_t lo_at = rows * npad / 2;  // pw[lo_at + i]: the lo parts of pw[i]'s two weights
  if constexpr (pairs) {
#if defined(KVRELAY_AVX512BF16)
    uint16_t* pb = reinterpret_cast<uint16_t*>(s.units(0, rows * npad));
    for (int64_t i = 0; i < rows * npad; i += 16) {
      const __m512 p = _mm512_loadu_ps(scores + i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + i), (__m256i)_mm512_cvtneps_pbh(p));
      const __m512 hi = load16(reinterpret_cast<const at::BFloat16*>(pb + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + rows * npad + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, hi)));
    }
    pw = reinterpret_cast<const uint32_t*>(pb);
#endif
  }
  float* outf = s.floats(2, rows * D);
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int64_t g0 = 0; g0 < group; g0 += GT) {
      const int64_t gt = std::min<int64_t>(GT, group - g0), row0 = hh * group + g0;
      Vf::R acc[GT][C];
      for (int g = 0; g < GT; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = Vf::zero();
      RowCursor<T> vals = a.rows(a.v, table, first, h0 + hh);
      const bool lead = g0 == 0;  // a head's later groups re-read values the first group brought in
      if constexpr (pairs) {
#if defined(KVRELAY_AVX512BF16)
        for (int64_t t = first; t < seq_len; t += 2) {
          const T* va = vals.next();
          const T* vb = t + 1 < seq_len ? vals.next() : va;  // its weight is 0
          if (lead) ahead.advance(2);
          const int64_t j = (t - first) / 2;
          for (int c = 0; c < C / 2; ++c) {
            const __m512i x = bf16x32(va, 32 * c), y = bf16x32(vb, 32 * c);
            const __m512i lo = interleave_pairs(x, y, 0), hi = interleave_pairs(x, y, 1);
            for (int g = 0; g < GT; ++g) {
              if (g >= gt) break;
              const int64_t at = ((row0 + g) * npad) / 2 + j;
              const __m512i w = _mm512_set1_epi32(static_cast<int>(pw[at]));
              const __m512i wl = _mm512_set1_epi32(static_cast<int>(pw[lo_at + at]));
              acc[g][2 * c] = dot_pairs(dot_pairs(acc[g][2 * c], lo, w), lo, wl);
              acc[g][2 * c + 1] = dot_pairs(dot_pairs(acc[g][2 * c + 1], hi, w), hi, wl);
            }
          }
        }
#endif
      } else {
        for (int64_t t = first; t < seq_len; ++t) {
          const T* vt = vals.next();
          if (lead) ahead.advance(1);
          Vf::R v[C];
          for (int c = 0; c < C; ++c) v[c] = load_w(vt, W * c);
          for (int g = 0; g < GT; ++g) {
            if (g >= gt) break;
            const Vf::R w = Vf::set1(scores[(row0 + g) * npad + (t - first)]);
            for (int c = 0; c < C; ++c) acc[g][c] = Vf::fma(w, v[c], acc[g][c]);
          }
        }
      }
      for (int g = 0; g < gt; ++g)
        for (int c = 0; c < C; ++c) Vf::store(outf + (row0 + g) * D + W * c, acc[g][c]);
    }
  }
  store_n(outf, a.out + (token * a.heads + h0 * group) * D, rows * D);
}
#endif

}  // namespace

// The same item on AMX tiles (paged_decode_amx.cpp); false where the build, the CPU or the shapes do not fit.
bool decode_item_amx(const AttnView<at::BFloat16, at::BFloat16>& a, const int32_t* table, int64_t token,
                     int64_t seq_len, int64_t first, int64_t h0, int64_t nh, Scratch& s);

template <typename T, typename Q>
void decode_item(const AttnView<T, Q>& a, int64_t r, int64_t token, int64_t seq_len, int64_t h0, int64_t nh,
                 Scratch& s) {
  const int32_t* table = a.tables + r * a.table_stride;
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, seq_len - a.window) : 0;
#if defined(KVRELAY_AVX512BF16)
  if constexpr (std::is_same<T, at::BFloat16>::value && std::is_same<Q, at::BFloat16>::value) {
    if (decode_item_amx(a, table, token, seq_len, first, h0, nh, s)) return;
  }
#endif
#if defined(KVRELAY_AVX512)
  if (a.d == 64) return decode_heads_w<T, Q, 64>(a, table, token, seq_len, first, h0, nh, s);
  if (a.d == 128) return decode_heads_w<T, Q, 128>(a, table, token, seq_len, first, h0, nh, s);
#elif defined(KVRELAY_AVX2)
  if (a.d == 64) return decode_heads_w<T, Q, 64>(a, table, token, seq_len, first, h0, nh, s);
#endif
  const int64_t group = a.group(), rows = nh * group, d = a.d;
  const float* qf = as_f32_n(a.q + token * a.q_stride + h0 * group * d, s.floats(1, rows * d), rows * d);
  float* of = s.floats(2, rows * d);
  switch (d) {
    case 64:
      decode_heads<T, 64>(qf, a.k, a.v, table, seq_len, first, a.bs, a.kvh, h0, nh, group, d, a.scale, of,
                             s.f[0]);
      break;
    case 128:
      decode_heads<T, 128>(qf, a.k, a.v, table, seq_len, first, a.bs, a.kvh, h0, nh, group, d, a.scale, of,
                             s.f[0]);
      break;
    default:
      decode_heads<T, 0>(qf, a.k, a.v, table, seq_len, first, a.bs, a.kvh, h0, nh, group, d, a.scale, of,
                             s.f[0]);
  }
  store_n(of, a.out + (token * a.heads + h0 * group) * d, rows * d);
}

template void decode_item(const AttnView<float, float>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void decode_item(const AttnView<float, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void decode_item(const AttnView<at::BFloat16, float>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void decode_item(const AttnView<at::BFloat16, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                          Scratch&);

template void decode_item(const AttnView<Fp8, float>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void decode_item(const AttnView<Fp8, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);

template void decode_item(const AttnView<Q8, float>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void decode_item(const AttnView<Q8, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);

}  // namespace kvrelay
