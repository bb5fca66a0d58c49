// Flash attention for multi-token chunks (prefills, first or continued) over the paged KV cache on CPU.
//
// One work item = a tile of a chunk's query tokens for one kv head: its rows are (token, query head of the
// group), up to a few vectors of them. The tile walks its visible keys in chunks of KC, reading them through
// the block table (no gathered copy of the context), with an online softmax:
//   1. stage the tile's queries transposed, Qt[unit][row], once;
//   2. per key chunk: stage its keys and values (converted to the compute units, zero past the end);
//      S[key][row] = scale * q . k, vectorised across rows, each key unit broadcast (a register tile of NK keys
//      x NR row vectors); mask what a row must not see (causal, window) with -inf; per row: new max, the
//      rescale factor of what came before, P = exp(S - max), running sum; O[e][row] = alpha O + sum P v;
//   3. write O / sum in the output's dtype.
// Units: fp32 numbers (fp32 FMAs; bf16 caches and queries widened exactly), or, with AVX512-BF16, bf16 queries
// and a bf16 or fp8 cache, bf16 pairs (vdpbf16ps: exact products summed in fp32; P rounded to bf16 for P . V, as
// GPU flash attention does; fp8 rows widened to bf16 exactly as they are staged, so an fp8 cache differs from a
// bf16 one in its stored values only). A row's result does not depend on the other rows of its tile (same chunks,
// same order).
#pragma GCC optimize("fp-contract=fast")

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention.h"
#include "common.h"
#include "vec.h"

namespace kvrelay {

#if defined(KVRELAY_AVX512) || defined(KVRELAY_AVX2)
namespace {

constexpr int W = Vf::W;
constexpr int64_t KC = 64;            // keys per softmax update (32 measured 5-20% slower, 16 worse still)
// Register tiles: 24 accumulators of 32 registers with 16 lanes (8 x 3); 12 of 16 with 8 lanes (4 x 3: with the
// three row vectors and a broadcast, all 16 registers, in both passes). With 16 lanes, halving them (4 x 3)
// measured 1.9x slower. With 8 lanes, 4 x 3 against the earlier 4 x 2 (whose 5-token tiles also left one row of
// 16 empty for a group of 3): one prompt, one layer of SmolLM2, 512 to 2,048 tokens, fp32 126-129 -> 147-152
// GFLOP/s, bf16 cache 117-120 -> 144-149; 6 keys x 2 (chunks of 60) 130 (AVX2-held Zen 4, 2 threads).
constexpr int NK = W == 16 ? 8 : 4;   // keys per QK register tile
constexpr int NR = 3;                 // row vectors per register tile
constexpr int NE = W == 16 ? 8 : 4;   // head elements per PV register tile

struct F32Units {
  using U = float;
  using B = Vf::R;
  static constexpr int per_unit = 1;
  static B vload(const U* p) { return Vf::load(p); }
  static B bcast(const U* p) { return Vf::set1(*p); }
  static Vf::R dot(Vf::R acc, B a, B b) { return Vf::fma(a, b, acc); }
};

#if defined(KVRELAY_AVX512BF16)
struct PairUnits {
  using U = uint32_t;
  using B = __m512i;
  static constexpr int per_unit = 2;
  static B vload(const U* p) { return _mm512_loadu_si512(p); }
  static B bcast(const U* p) { return _mm512_set1_epi32(static_cast<int>(*p)); }
  static __m512 dot(__m512 acc, B a, B b) { return dot_pairs(acc, a, b); }
};
#endif

// S[k][r] = scale * sum_u K[k][u] Qt[u][r] for nk keys (row pointers) and nr row vectors.
template <class M, int nk, int nr>
inline void qk_tile(const typename M::U* const* K, int64_t units, const typename M::U* Qt, int64_t mp, float* S,
                    float scale) {
  Vf::R acc[nk][nr];
  for (int k = 0; k < nk; ++k)
    for (int r = 0; r < nr; ++r) acc[k][r] = Vf::zero();
  for (int64_t u = 0; u < units; ++u) {
    typename M::B b[nr];
    for (int r = 0; r < nr; ++r) b[r] = M::vload(Qt + u * mp + r * W);
    for (int k = 0; k < nk; ++k) {
      const typename M::B x = M::bcast(K[k] + u);
      for (int r = 0; r < nr; ++r) acc[k][r] = M::dot(acc[k][r], x, b[r]);
    }
  }
  const Vf::R sc = Vf::set1(scale);
  for (int k = 0; k < nk; ++k)
    for (int r = 0; r < nr; ++r) Vf::store(S + k * mp + r * W, Vf::mul(acc[k][r], sc));
}

// O[e][r] = alpha[r] O[e][r] + sum_j V[j][e0 + e] P[j][r] for ne head elements and nr row vectors; V by row
// pointers, P and O rows `mp` floats (or units) apart.
template <class M, int ne, int nr>
inline void pv_tile(const typename M::U* const* V, int64_t e0, const typename M::U* P, int64_t mp, int64_t n,
                    float* O, const float* alpha) {
  Vf::R acc[ne][nr];
  for (int r = 0; r < nr; ++r) {
    const Vf::R al = Vf::load(alpha + r * W);
    for (int e = 0; e < ne; ++e) acc[e][r] = Vf::mul(Vf::load(O + e * mp + r * W), al);
  }
  for (int64_t j = 0; j < n; ++j) {
    typename M::B b[nr];
    for (int r = 0; r < nr; ++r) b[r] = M::vload(P + j * mp + r * W);
    for (int e = 0; e < ne; ++e) {
      const typename M::B x = M::bcast(V[j] + e0 + e);
      for (int r = 0; r < nr; ++r) acc[e][r] = M::dot(acc[e][r], x, b[r]);
    }
  }
  for (int e = 0; e < ne; ++e)
    for (int r = 0; r < nr; ++r) Vf::store(O + e * mp + r * W, acc[e][r]);
}

// The register tiles over all rv row vectors: NR at a time, then the rest.
template <class M>
void qk_rows(const typename M::U* const* K, int64_t units, const typename M::U* Qt, int64_t mp, int64_t rv, float* S,
             float scale) {
  int64_t r = 0;
  for (; r + NR <= rv; r += NR) qk_tile<M, NK, NR>(K, units, Qt + r * W, mp, S + r * W, scale);
  if (rv - r == 2) qk_tile<M, NK, 2>(K, units, Qt + r * W, mp, S + r * W, scale);
  if (rv - r == 1) qk_tile<M, NK, 1>(K, units, Qt + r * W, mp, S + r * W, scale);
}

template <class M>
void pv_rows(const typename M::U* const* V, int64_t d, const typename M::U* P, int64_t mp, int64_t n, int64_t rv,
             float* O, const float* alpha) {
  for (int64_t e = 0; e < d; e += NE) {
    int64_t r = 0;
    for (; r + NR <= rv; r += NR) pv_tile<M, NE, NR>(V, e, P + r * W, mp, n, O + e * mp + r * W, alpha + r * W);
    if (rv - r == 2) pv_tile<M, NE, 2>(V, e, P + r * W, mp, n, O + e * mp + r * W, alpha + r * W);
    if (rv - r == 1) pv_tile<M, NE, 1>(V, e, P + r * W, mp, n, O + e * mp + r * W, alpha + r * W);
  }
}

// Element e of a row as a unit: an fp32 number, or the bf16 pair (2e, 2e + 1).
template <class M, typename T>
inline typename M::U unit_at(const T* row, int64_t e) {
  if constexpr (M::per_unit == 1) {
    return load(row, e);
  } else {
    uint32_t u;
    std::memcpy(&u, row + 2 * e, sizeof u);
    return u;
  }
}

// Row pointers to the chunk's keys and values in compute units. Where the cache already holds them that way
// (fp32 cache and fp32 units; a bf16 cache's key rows are bf16 pairs) they point into the cache; otherwise the
// rows are converted into the K and V buffers (values in pairs mode: keys 2j and 2j + 1 interleaved in row j).
// Rows past `count` point at a zero row.
template <class M, typename T, typename Q>
void stage_kv(const AttnView<T, Q>& a, const int32_t* table, int64_t k0, int64_t count, int64_t padded, int64_t h,
              typename M::U* K, typename M::U* V, const typename M::U* zero, const typename M::U** krows,
              const typename M::U** vrows) {
  using U = typename M::U;
  constexpr bool in_place = M::per_unit == 1 ? std::is_same<T, float>::value : std::is_same<T, at::BFloat16>::value;
  const int64_t d = a.d, units = d / M::per_unit;
  RowCursor<T> keys = a.rows(a.k, table, k0, h), vals = a.rows(a.v, table, k0, h);
  for (int64_t t = 0; t < padded; ++t) {
    if (t >= count) {
      krows[t] = zero;
      continue;
    }
    const T* src = keys.next();
    if constexpr (in_place) {
      krows[t] = reinterpret_cast<const U*>(src);
    } else {
      U* kr = K + t * units;
#if defined(KVRELAY_AVX512BF16)
      if constexpr (M::per_unit == 2 && std::is_same<T, Fp8>::value)
        fp8_row_as_bf16(src, d, reinterpret_cast<uint16_t*>(kr));
      else
#endif
        for (int64_t u = 0; u < units; ++u) kr[u] = unit_at<M>(src, u);
      krows[t] = kr;
    }
  }
  if constexpr (M::per_unit == 1) {
    for (int64_t t = 0; t < padded; ++t) {
      if (t >= count) {
        vrows[t] = zero;
        continue;
      }
      const T* src = vals.next();
      if constexpr (in_place) {
        vrows[t] = reinterpret_cast<const U*>(src);
      } else {
        float* vr = reinterpret_cast<float*>(V) + t * d;
        for (int64_t e = 0; e < d; ++e) vr[e] = load(src, e);
        vrows[t] = vr;
      }
    }
  } else {
#if defined(KVRELAY_AVX512BF16)
    alignas(64) uint16_t widened[2][256];  // an fp8 cache's two value rows as bf16
    auto next = [&](int i) -> const void* {
      if constexpr (std::is_same<T, Fp8>::value) {
        fp8_row_as_bf16(vals.next(), d, widened[i]);
        return widened[i];
      } else {
        return vals.next();
      }
    };
    for (int64_t j = 0; j < padded / 2; ++j) {
      const int64_t t = 2 * j;
      const void* x = t < count ? next(0) : kZeroRow;
      const void* y = t + 1 < count ? next(1) : kZeroRow;
      store_pair_row(x, y, d, V + j * d);
      vrows[j] = V + j * d;
    }
#endif
  }
}

template <class M, typename T, typename Q>
void tile(const AttnView<T, Q>& a, int64_t r, int64_t tok0, int64_t n, int64_t pos0, int64_t h, Scratch& s) {
  using U = typename M::U;
  const int64_t group = a.group(), d = a.d, units = d / M::per_unit;
  const int64_t rows = n * group, rv = (rows + W - 1) / W, mp = rv * W;
  const int32_t* table = a.tables + r * a.table_stride;
  U* Qt = reinterpret_cast<U*>(s.units(0, units * mp));
  U* K = reinterpret_cast<U*>(s.units(1, KC * units));
  U* V = reinterpret_cast<U*>(s.units(2, KC * d));
  U* zero = reinterpret_cast<U*>(s.units(4, d));
  std::fill(zero, zero + d, U(0));
  const U* krows[KC];
  const U* vrows[KC];
  U* P = reinterpret_cast<U*>(s.units(3, KC * mp));
  float* S = s.floats(0, KC * mp);
  float* O = s.floats(1, d * mp);
  float* m = s.floats(2, mp);
  float* l = s.floats(3, mp);
  float* alpha = s.floats(4, mp);
  float* pos = s.floats(5, mp);
  // 1. Queries, transposed; rows past the tile are zero and sit at its last position (never all masked).
  for (int64_t i = 0; i < mp; ++i) {
    const int64_t j = std::min(i / group, n - 1);
    pos[i] = static_cast<float>(pos0 + j);
    m[i] = -INFINITY;
    l[i] = 0.f;
    if (i >= rows) {
      for (int64_t u = 0; u < units; ++u) Qt[u * mp + i] = U(0);
      continue;
    }
    const Q* q = a.q + (tok0 + j) * a.q_stride + (h * group + i % group) * d;
    for (int64_t u = 0; u < units; ++u) Qt[u * mp + i] = unit_at<M>(q, u);
  }
  std::fill(O, O + d * mp, 0.f);
  const int64_t last = pos0 + n - 1;
  const int64_t begin = a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0;
  for (int64_t k0 = begin; k0 <= last; k0 += KC) {
    // 2. One chunk of keys.
    const int64_t count = std::min(KC, last + 1 - k0), padded = (count + NK - 1) / NK * NK;
    stage_kv<M>(a, table, k0, count, padded, h, K, V, zero, krows, vrows);
    for (int64_t t = 0; t < padded; t += NK) qk_rows<M>(krows + t, units, Qt, mp, rv, S + t * mp, a.scale);
    const bool all_visible = count == padded && k0 + count - 1 <= pos0 && (a.window <= 0 || k0 > last - a.window);
    if (!all_visible) {
      for (int64_t t = 0; t < padded; ++t) {
        const Vf::R kp = Vf::set1(static_cast<float>(t < count ? k0 + t : INFINITY));
        const Vf::R kw = Vf::set1(static_cast<float>(k0 + t + a.window));
        for (int64_t i = 0; i < mp; i += W) {
          Vf::R sc = Vf::keep_le(Vf::load(S + t * mp + i), kp, Vf::load(pos + i));
          if (a.window > 0) sc = Vf::keep_gt(sc, kw, Vf::load(pos + i));
          Vf::store(S + t * mp + i, sc);
        }
      }
    }
    for (int64_t i = 0; i < mp; i += W) {
      const Vf::R old = Vf::load(m + i);
      Vf::R mx = old;
      for (int64_t t = 0; t < padded; ++t) mx = Vf::max(mx, Vf::load(S + t * mp + i));
      const Vf::R ms = Vf::select_if_neg_inf(mx, Vf::zero());  // nothing visible yet: keep exp finite
      Vf::R sum = Vf::zero();
      for (int64_t t = 0; t < padded; ++t) {
        const Vf::R p = Vf::exp_neg(Vf::sub(Vf::load(S + t * mp + i), ms));
        Vf::store(S + t * mp + i, p);
        sum = Vf::add(sum, p);
      }
      const Vf::R al = Vf::exp_neg(Vf::sub(old, ms));
      Vf::store(alpha + i, al);
      Vf::store(l + i, Vf::fma(Vf::load(l + i), al, sum));
      Vf::store(m + i, mx);
    }
    if constexpr (M::per_unit == 1) {
      pv_rows<M>(vrows, d, reinterpret_cast<const U*>(S), mp, padded, rv, O, alpha);
    } else {
#if defined(KVRELAY_AVX512BF16)
      for (int64_t j = 0; j < padded / 2; ++j)
        for (int64_t i = 0; i < mp; i += W)
          _mm512_storeu_si512(P + j * mp + i, pack_pairs(Vf::load(S + 2 * j * mp + i), Vf::load(S + (2 * j + 1) * mp + i)));
      pv_rows<M>(vrows, d, P, mp, padded / 2, rv, O, alpha);
#endif
    }
  }
  // 3. out = O / sum, back to [token, head, d].
  float* row = s.floats(6, d);
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = 1.f / l[i];
    for (int64_t e = 0; e < d; ++e) row[e] = O[e * mp + i] * inv;
    store_n(row, a.out + ((tok0 + i / group) * a.heads + h * group + i % group) * d, d);
  }
}

}  // namespace

// Two row-register tiles per item measured slower (less parallel slack, no more reuse).
int64_t prefill_tile_tokens(int64_t group) { return std::max<int64_t>(1, (W * NR) / group); }

// The same item on AMX tiles (paged_prefill_amx.cpp); false where the build or the CPU has none.
bool prefill_item_amx(const AttnView<at::BFloat16, at::BFloat16>& a, int64_t r, int64_t tok0, int64_t n,
                      int64_t pos0, int64_t h, Scratch& s);

template <typename T, typename Q>
void prefill_item(const AttnView<T, Q>& a, int64_t r, int64_t tok0, int64_t n, int64_t pos0, int64_t h, Scratch& s) {
#if defined(KVRELAY_AVX512BF16)
  if constexpr (std::is_same<T, at::BFloat16>::value && std::is_same<Q, at::BFloat16>::value) {
    if (prefill_item_amx(a, r, tok0, n, pos0, h, s)) return;
  }
  // bf16 pairs for bf16 queries over a bf16 cache, or an fp8 one widened to bf16 as it is staged.
  if constexpr ((std::is_same<T, at::BFloat16>::value || std::is_same<T, Fp8>::value) &&
                std::is_same<Q, at::BFloat16>::value) {
    if (a.d % 32 == 0) return tile<PairUnits>(a, r, tok0, n, pos0, h, s);
  }
#endif
  tile<F32Units>(a, r, tok0, n, pos0, h, s);
}

#else  // no vector unit the kernel is written for: the caller uses the portable path for prefills

int64_t prefill_tile_tokens(int64_t) { return 0; }

template <typename T, typename Q>
void prefill_item(const AttnView<T, Q>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&) {
  TORCH_CHECK(false, "native prefill attention needs AVX2 or AVX512");
}

#endif

template void prefill_item(const AttnView<float, float>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void prefill_item(const AttnView<float, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void prefill_item(const AttnView<at::BFloat16, float>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void prefill_item(const AttnView<at::BFloat16, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                           Scratch&);

template void prefill_item(const AttnView<Fp8, float>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void prefill_item(const AttnView<Fp8, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);

template void prefill_item(const AttnView<Q8, float>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);
template void prefill_item(const AttnView<Q8, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);

}  // namespace kvrelay
