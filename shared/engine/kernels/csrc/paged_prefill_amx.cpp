// Prefill items (paged_prefill.cpp's work items) on AMX tile units, for a bf16 cache and bf16 queries: the two
// matrix products of flash attention on the tiles, the online softmax in AVX512. On an AMX Xeon the tiles do a
// 16 x 16 x 32 product per instruction, so the AVX512-BF16 register tiles' dot products stop being the cost.
//   1. stage the item's query rows (token, query head of the group) row-major, zero past the end;
//   2. stage every chunk of KC = 32 keys the item sees, once for all its row tiles: K^T as bf16 pairs (the B
//      tiles of Q K^T, by 16 x 16 transposes) and V with keys 2j and 2j + 1 interleaved in row j (the B tiles
//      of P V);
//   3. per 16 query rows, over the chunks they can see, a segment of kSegChunks chunks at a time: S = Q K^T for the
//      whole segment on the tiles (the queries stay loaded); one softmax pass over the segment's scores (masked:
//      causal, window, past the end): a row's maximum m only rises from one segment to the next, and what it
//      summed before is rescaled then; P = exp(S - m) rounded to bf16 (as the AVX512-BF16 path and GPU flash
//      attention round it); O += P V. Loads go to tiles the product before them does not read, so they need not
//      wait for it;
//   4. write O / sum in the output's dtype.
// A row's result does not depend on the other rows of its item (same chunks, same order, its own m).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention.h"
#include "common.h"
#include "amx.h"
#include "vec.h"

namespace kvrelay {

#if defined(KVRELAY_AMX)
namespace {

constexpr int64_t KC = 32;  // keys per chunk: one A tile's width of P in bf16
constexpr int TR = 16;      // rows per tile
// Query rows per item (token x query head): the item stages its keys and values once for all its row tiles. 2048
// new tokens, one layer: 8.3 ms at 96 rows, 7.6 at 192, 7.0 at 384; 768 leaves 512-token prompts unbalanced.
constexpr int64_t kItemRows = 384;
// Key chunks per segment: a row tile's scores (16 x 512 fp32) and P (bf16) stay in L1 and L2 between the passes.
constexpr int64_t kSegChunks = 16;

using Bf = at::BFloat16;

// out[p * 16 + t] = rows[t][p] for 16 rows of 16 uint32 (bf16 pairs).
void transpose16(const uint32_t* const* rows, uint32_t* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i]);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < 4; ++i) {
      t[8 * j + i] = _mm512_shuffle_i32x4(r[8 * j + i], r[8 * j + i + 4], 0x88);
      t[8 * j + i + 4] = _mm512_shuffle_i32x4(r[8 * j + i], r[8 * j + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_si512(out + i * 16, _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_si512(out + (i + 8) * 16, _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd));
  }
}

// Chunk keys [k0, k0 + count) of kv head h: Kt[(c * 2 + half) * 256 + p * 16 + t] = the pair (2p, 2p + 1) of
// dims [32c, 32c + 32) of key 16 half + t (16 x 16 transposes); Vv[j * d + e] = (V[2j][e], V[2j + 1][e]).
// Zero past `count`.
void stage_chunk(const AttnView<Bf, Bf>& a, const int32_t* table, int64_t k0, int64_t count, int64_t h, uint32_t* Kt,
                 uint32_t* Vv) {
  const int64_t d = a.d, chunks = d / 32;
  alignas(64) static const uint32_t zeros[16] = {};
  RowCursor<Bf> keys = a.rows(a.k, table, k0, h), vals = a.rows(a.v, table, k0, h);
  const uint32_t* key[KC];
  for (int64_t t = 0; t < KC; ++t) key[t] = t < count ? reinterpret_cast<const uint32_t*>(keys.next()) : nullptr;
  for (int64_t half = 0; half < 2; ++half)
    for (int64_t c = 0; c < chunks; ++c) {
      const uint32_t* rows[16];
      for (int t = 0; t < 16; ++t) rows[t] = key[16 * half + t] ? key[16 * half + t] + c * 16 : zeros;
      transpose16(rows, Kt + (c * 2 + half) * 256);
    }
  for (int64_t j = 0; j < KC / 2; ++j) {
    const void* x = 2 * j < count ? static_cast<const void*>(vals.next()) : kZeroRow;
    const void* y = 2 * j + 1 < count ? static_cast<const void*>(vals.next()) : kZeroRow;
    store_pair_row(x, y, d, Vv + j * d);
  }
}

// One chunk's scores for the 16 rows whose queries sit in tiles 0..NQ-1 (32 dims each): tiles SA and SB (keys
// 0-15 and 16-31) = Q K^T, started from `acc` (the earlier dims' sums) or zero, stored to s (rows sb bytes apart).
// K^T goes through tiles 6 and 7, so the next chunk's loads need not wait for this chunk's products.
// (Macros: the tile intrinsics take their tile numbers as literals.)
#define KVRELAY_QK_DIMS(QI, SA, SB, k)            \
  _tile_loadd(6, (k) + (QI * 2) * 256, 64);      \
  _tile_dpbf16ps(SA, QI, 6);                     \
  _tile_loadd(7, (k) + (QI * 2 + 1) * 256, 64);  \
  _tile_dpbf16ps(SB, QI, 7)
#define KVRELAY_QK_CHUNK(NQ, SA, SB, k, acc, s, sb) \
  do {                                              \
    if ((acc) != nullptr) {                         \
      _tile_loadd(SA, (acc), (sb));                 \
      _tile_loadd(SB, (acc) + 16, (sb));            \
    } else {                                        \
      _tile_zero(SA);                               \
      _tile_zero(SB);                               \
    }                                               \
    KVRELAY_QK_DIMS(0, SA, SB, k);                  \
    KVRELAY_QK_DIMS(1, SA, SB, k);                  \
    if (NQ == 4) {                                  \
      KVRELAY_QK_DIMS(2, SA, SB, k);                \
      KVRELAY_QK_DIMS(3, SA, SB, k);                \
    }                                               \
    _tile_stored(SA, (s), (sb));                    \
    _tile_stored(SB, (s) + 16, (sb));               \
  } while (0)

// S[r][j] = q_r . k_j for 16 query rows (Q, rows d apart) and the keys of chunks [c0, c1) (S rows ss apart). The
// queries stay in the tiles for the whole walk: a head size of 64 in tiles 0-1, which leaves two pairs of sum tiles
// to alternate between chunks; larger ones 128 dims (tiles 0-3) at a time, summing over the dims in S.
void scores(const uint16_t* Q, int64_t d, const uint32_t* Kt, int64_t c0, int64_t c1, float* S, int64_t ss) {
  const int64_t kt = d / 32 * 2 * 256, sb = ss * 4;
  if (d == 64) {
    _tile_loadd(0, Q, d * 2);
    _tile_loadd(1, Q + 32, d * 2);
    const float* none = nullptr;
    for (int64_t c = c0; c < c1; c += 2) {
      KVRELAY_QK_CHUNK(2, 2, 3, Kt + c * kt, none, S + (c - c0) * KC, sb);
      if (c + 1 < c1) KVRELAY_QK_CHUNK(2, 4, 5, Kt + (c + 1) * kt, none, S + (c + 1 - c0) * KC, sb);
    }
    return;
  }
  for (int64_t q0 = 0; q0 < d / 32; q0 += 4) {
    const bool four = d / 32 - q0 >= 4;  // else the last 64 dims of a head size 64 past a multiple of 128
    _tile_loadd(0, Q + q0 * 32, d * 2);
    _tile_loadd(1, Q + (q0 + 1) * 32, d * 2);
    if (four) {
      _tile_loadd(2, Q + (q0 + 2) * 32, d * 2);
      _tile_loadd(3, Q + (q0 + 3) * 32, d * 2);
    }
    for (int64_t c = c0; c < c1; ++c) {
      float* s = S + (c - c0) * KC;
      const uint32_t* k = Kt + c * kt + q0 * 2 * 256;
      const float* acc = q0 > 0 ? s : nullptr;
      if (four) KVRELAY_QK_CHUNK(4, 4, 5, k, acc, s, sb);
      else KVRELAY_QK_CHUNK(2, 4, 5, k, acc, s, sb);
    }
  }
}

// 2^t for t <= 0 (t a little above 0 is fine too), to ~2^-22 relative: 2^round(t) times a degree-5 fit of 2^f on
// [-1/2, 1/2]. Below -125 it gives ~2^-125 (a normal number) rather than 0: beside a row's maximum, whose weight is 1,
// such weights vanish in every sum, and no denormal ever reaches the arithmetic (which would be slow).
inline __m512 exp2_le0(__m512 t) {
  t = _mm512_max_ps(t, Vf::set1(-125.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = Vf::set1(1.3275318779e-3f);
  p = Vf::fma(p, f, Vf::set1(9.6751442179e-3f));
  p = Vf::fma(p, f, Vf::set1(5.5507134646e-2f));
  p = Vf::fma(p, f, Vf::set1(2.4022127688e-1f));
  p = Vf::fma(p, f, Vf::set1(6.9314694405e-1f));
  p = Vf::fma(p, f, Vf::set1(1.0000001192f));
  return _mm512_scalef_ps(p, n);
}

// The segment's softmax for 16 rows: keys [k0, k0 + n) (n a multiple of KC), S and P rows ss apart. A row sees keys
// [lo, pos] (lo: the window's first key, or the segment's); others get P = 0. Scores are kept in base 2 (times
// scale log2 e) so that one FMA turns a score into the exponent. A row's maximum m rises to the segment's when that
// is higher, and alpha[r] is then the factor for what it summed before. P = 2^(S scale log2 e - m) <= 1, rounded to
// bf16 (as the AVX512-BF16 path and GPU flash attention round it); the sums are of the fp32 values, per lane.
// Returns whether some row's earlier sums must be rescaled.
bool softmax_rows(const float* S, int64_t ss, uint16_t* P, const float* pos, int64_t k0, int64_t n, int64_t window,
                  float scale, float* m, float* lsum, float* alpha) {
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const float c2 = scale * 1.44269504088896341f;  // score -> base-2 exponent
  bool rescale = false;
  for (int r = 0; r < TR; ++r) {
    const float* s = S + r * ss;
    const int64_t hi = static_cast<int64_t>(pos[r]) - k0;  // last visible key, relative
    const int64_t lo = window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(pos[r]) - window + 1 - k0) : 0;
    const int64_t j0 = lo / 16 * 16, vend = std::min<int64_t>(n, hi + 1);
    // Lanes of the vector at j that the row sees; all of them away from the edges.
    auto visible = [&](int64_t j) -> __mmask16 {
      if (j >= lo && j + 15 <= hi) return 0xffff;
      const __m512 key = _mm512_add_ps(lane, Vf::set1(static_cast<float>(j)));
      return _mm512_cmp_ps_mask(key, Vf::set1(static_cast<float>(hi)), _CMP_LE_OQ) &
             _mm512_cmp_ps_mask(key, Vf::set1(static_cast<float>(lo)), _CMP_GE_OQ);
    };
    // The largest scaled score is the largest raw one (scale > 0: prefill_item_amx takes no other).
    __m512 mx = Vf::set1(-INFINITY);
    for (int64_t j = j0; j < vend; j += 16) mx = _mm512_mask_max_ps(mx, visible(j), mx, Vf::load(s + j));
    const float top = vend > j0 ? Vf::hmax(mx) * c2 : -INFINITY;
    alpha[r] = 1.f;
    if (top > m[r]) {
      if (m[r] != -INFINITY) {  // rows with nothing seen yet have O = 0 and sum 0
        alpha[r] = std::exp2(m[r] - top);
        Vf::store(lsum + r * 16, Vf::mul(Vf::load(lsum + r * 16), Vf::set1(alpha[r])));
        rescale = true;
      }
      m[r] = top;
    }
    const __m512 mr = Vf::set1(m[r] == -INFINITY ? 0.f : -m[r]), c = Vf::set1(c2);
    __m512 sum = Vf::load(lsum + r * 16);
    uint16_t* p = P + r * ss;
    for (int64_t j = 0; j < n; j += 32) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t jj = j + 16 * h;
        const __mmask16 keep = jj < j0 || jj >= vend ? 0 : visible(jj);
        e[h] = keep == 0 ? Vf::zero() : _mm512_maskz_mov_ps(keep, exp2_le0(Vf::fma(Vf::load(s + jj), c, mr)));
        sum = Vf::add(sum, e[h]);
      }
      _mm512_storeu_si512(p + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e[1], e[0])));
    }
    Vf::store(lsum + r * 16, sum);
  }
  return rescale;
}

// One chunk's P V into the sum tiles 4-7 (64 output dims): P in tile PT, V's four 16-dim slices by turns in VA, VB.
#define KVRELAY_PV_CHUNK(PT, VA, VB, p, v, pb, vb) \
  do {                                            \
    _tile_loadd(PT, (p), (pb));                   \
    _tile_loadd(VA, (v), (vb));                   \
    _tile_dpbf16ps(4, PT, VA);                    \
    _tile_loadd(VB, (v) + 16, (vb));              \
    _tile_dpbf16ps(5, PT, VB);                    \
    _tile_loadd(VA, (v) + 32, (vb));              \
    _tile_dpbf16ps(6, PT, VA);                    \
    _tile_loadd(VB, (v) + 48, (vb));              \
    _tile_dpbf16ps(7, PT, VB);                    \
  } while (0)

// O [16][d] (fp32, in memory between segments) += P V over chunks [c0, c1), 64 dims a time in sum tiles 4-7;
// P through tiles 0-1 and V through tiles 2-3 by turns, so that a load need not wait for the product before it.
void values(const uint16_t* P, int64_t ss, const uint32_t* Vv, int64_t d, int64_t c0, int64_t c1, bool first,
            float* O) {
  const int64_t vv = KC / 2 * d, ob = d * 4, vb = d * 4;
  for (int64_t e0 = 0; e0 < d; e0 += 64) {
    if (first) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
    } else {
      _tile_loadd(4, O + e0, ob);
      _tile_loadd(5, O + e0 + 16, ob);
      _tile_loadd(6, O + e0 + 32, ob);
      _tile_loadd(7, O + e0 + 48, ob);
    }
    for (int64_t c = c0; c < c1; ++c) {
      const uint32_t* v = Vv + c * vv + e0;
      const uint16_t* p = P + (c - c0) * KC;
      if ((c - c0) % 2 == 0) KVRELAY_PV_CHUNK(0, 2, 3, p, v, ss * 2, vb);
      else KVRELAY_PV_CHUNK(1, 3, 2, p, v, ss * 2, vb);
    }
    _tile_stored(4, O + e0, ob);
    _tile_stored(5, O + e0 + 16, ob);
    _tile_stored(6, O + e0 + 32, ob);
    _tile_stored(7, O + e0 + 48, ob);
  }
}

// Rows [16 t, 16 t + 16) over chunks [c_lo, c_hi], a segment at a time: scores, softmax, O += P V (O: 16 x d
// fp32 scratch); then O / sum in the output's dtype, to dst[i] for the `valid` rows.
void row_tile(const AttnView<Bf, Bf>& a, const uint16_t* Q, const uint32_t* Kt, const uint32_t* Vv, int64_t c_lo,
              int64_t c_hi, int64_t begin, const float* pos, Scratch& s, float* O, int64_t valid, Bf* const* dst) {
  const int64_t d = a.d, ss = kSegChunks * KC;
  float* S = s.floats(0, TR * ss);
  uint16_t* P = reinterpret_cast<uint16_t*>(s.units(3, TR * ss / 2));
  float* m = s.floats(2, TR);
  float* lsum = s.floats(3, TR * 16);
  float* alpha = s.floats(4, TR);
  for (int r = 0; r < TR; ++r) m[r] = -INFINITY;
  std::fill(lsum, lsum + TR * 16, 0.f);
  for (int64_t c0 = c_lo; c0 <= c_hi; c0 += kSegChunks) {
    const int64_t c1 = std::min(c0 + kSegChunks, c_hi + 1);
    scores(Q, d, Kt, c0, c1, S, ss);
    if (softmax_rows(S, ss, P, pos, begin + c0 * KC, (c1 - c0) * KC, a.window, a.scale, m, lsum, alpha) && c0 > c_lo) {
      for (int r = 0; r < TR; ++r) {
        const __m512 f = Vf::set1(alpha[r]);
        for (int64_t e = 0; e < d; e += 16) Vf::store(O + r * d + e, Vf::mul(Vf::load(O + r * d + e), f));
      }
    }
    values(P, ss, Vv, d, c0, c1, c0 == c_lo, O);
  }
  for (int64_t i = 0; i < valid; ++i) {
    const __m512 inv = Vf::set1(1.f / Vf::hsum(Vf::load(lsum + i * 16)));
    for (int64_t e = 0; e < d; e += 16) store16(dst[i] + e, Vf::mul(Vf::load(O + i * d + e), inv));
  }
}

void tile(const AttnView<Bf, Bf>& a, int64_t r, int64_t tok0, int64_t n, int64_t pos0, int64_t h, Scratch& s) {
  const int64_t group = a.group(), d = a.d, rows = n * group, rt = (rows + TR - 1) / TR, mp = rt * TR;
  const int32_t* table = a.tables + r * a.table_stride;
  const int64_t last = pos0 + n - 1;
  const int64_t begin = a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0;
  const int64_t chunks = (last - begin) / KC + 1, kt = d / 32 * 2 * 256, vv = KC / 2 * d;
  uint16_t* Q = reinterpret_cast<uint16_t*>(s.units(0, mp * d / 2));
  uint32_t* Kt = s.units(1, chunks * kt);
  uint32_t* Vv = s.units(2, chunks * vv);
  float* pos = s.floats(1, mp);
  float* O = s.floats(6, TR * d);
  // 1. Queries; rows past the item are zero and sit at its last position (never all masked).
  for (int64_t i = 0; i < mp; ++i) {
    const int64_t j = std::min(i / group, n - 1);
    pos[i] = static_cast<float>(pos0 + j);
    uint16_t* dst = Q + i * d;
    if (i >= rows) {
      std::fill(dst, dst + d, uint16_t(0));
      continue;
    }
    std::memcpy(dst, a.q + (tok0 + j) * a.q_stride + (h * group + i % group) * d, d * sizeof(Bf));
  }
  // 2. Every chunk of keys the item sees, staged once for all its row tiles.
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = begin + c * KC;
    stage_chunk(a, table, k0, std::min(KC, last + 1 - k0), h, Kt + c * kt, Vv + c * vv);
  }
  configure_tiles();
  for (int64_t t = 0; t < rt; ++t) {
    // 3. Per row tile, the chunks its rows can see.
    const float* tp = pos + t * TR;
    const int64_t c_hi = (static_cast<int64_t>(tp[TR - 1]) - begin) / KC;
    const int64_t c_lo = a.window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(tp[0]) - a.window + 1 - begin) / KC : 0;
    Bf* dst[TR];
    const int64_t valid = std::min<int64_t>(TR, rows - t * TR);
    for (int64_t i = 0; i < valid; ++i) {
      const int64_t ri = t * TR + i;
      dst[i] = a.out + ((tok0 + ri / group) * a.heads + h * group + ri % group) * d;
    }
    row_tile(a, Q + t * TR * d, Kt, Vv, c_lo, c_hi, begin, tp, s, O, valid, dst);
  }
  _tile_release();
}

}  // namespace

int64_t prefill_tile_tokens_amx(int64_t d, int64_t group) {
  if (d % 64 != 0 || !amx_permitted()) return 0;
  return std::max<int64_t>(1, kItemRows / group);
}

bool prefill_item_amx(const AttnView<at::BFloat16, at::BFloat16>& a, int64_t r, int64_t tok0, int64_t n,
                      int64_t pos0, int64_t h, Scratch& s) {
  if (prefill_tile_tokens_amx(a.d, a.group()) == 0 || !(a.scale > 0)) return false;  // softmax_rows' maximum
  tile(a, r, tok0, n, pos0, h, s);
  return true;
}

#else

int64_t prefill_tile_tokens_amx(int64_t, int64_t) { return 0; }

bool prefill_item_amx(const AttnView<at::BFloat16, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                      Scratch&) {
  return false;
}

#endif

}  // namespace kvrelay
