// Prefill items (paged_prefill.cpp's work items) on AMX tile units, for a bf16 cache and bf16 queries: the two
// matrix products of flash attention on the tiles, the online softmax in AVX512. The products run transposed,
// keys and output dims along the tile rows and query rows along the lanes, so that every softmax reduction
// (a row's maximum, its sum) is a vertical vector op rather than a horizontal one per row, and masks are built
// only for the chunks a row's bounds cut. One layer, AMX Xeon, 2 vCPUs, alternating builds: 4 x 512 new tokens
// 2.22-2.35 -> 1.95 ms, 2 x 1024 3.8-4.6 -> 3.4-3.7 ms against the row-major softmax this replaced. What is left
// is mostly the tile unit waiting on operand loads from L2 (~60 cycles a product): docs/benchmarks.md.
//   1. stage every chunk of KC = 32 keys the item sees, once for all its row tiles: K rows as they are (the A
//      tiles of S^T = K Q^T) and V^T with keys 2j and 2j + 1 as the pair in column j (the A tiles of O^T = V^T P^T);
//   2. per 16 query rows (token, query head of the group): Q^T as bf16 pairs of dims (the B tiles of K Q^T);
//   3. over the chunks those rows can see: S^T on the tiles, mask (causal, window) only in chunks that cross a
//      row's bounds, P = 2^(S scale log2(e) - m) rounded to bf16 (as the AVX512-BF16 path and GPU flash
//      attention round it), O^T += V^T P^T in four sum tiles that stay on the tile unit for the whole walk. A
//      row's reference maximum m moves only when a chunk's exceeds it by more than kLazy, and only then is O
//      rescaled;
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

constexpr int64_t KC = 32;  // keys per chunk: one B tile of P^T holds 16 pairs of keys
constexpr int TR = 16;      // rows per tile
// Query rows per item (token x query head): the item stages its keys and values once for all its row tiles. 2048
// new tokens, one layer: 8.3 ms at 96 rows, 7.6 at 192, 7.0 at 384; 768 leaves 512-token prompts unbalanced.
constexpr int64_t kItemRows = 384;
constexpr float kLazy = 8.f;  // how far (in log2) a row's running maximum may rise before O is rescaled: P <= 256

using Bf = at::BFloat16;

// out[p * 16 + t] = rows[t][p] for 16 rows of 16 uint32 (bf16 pairs, or fp32).
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

// 2^y for finite y, within ~3e-6 relative (P is rounded to bf16 after, 2e-3): degree-5 Taylor on [-0.5, 0.5].
inline __m512 exp2_finite(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = Vf::set1(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, Vf::set1(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, Vf::set1(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, Vf::set1(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, Vf::set1(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, Vf::set1(1.f));
  return _mm512_scalef_ps(p, n);
}

// Chunk keys [k0, k0 + count) of kv head h, zero past `count`: Kc[t * d + e] = K[k0 + t][e];
// Vt[(i * 16 + e) * 16 + j] = the pair (V[k0 + 2j][16 i + e], V[k0 + 2j + 1][16 i + e]), by 16 x 16 transposes.
void stage_chunk(const AttnView<Bf, Bf>& a, const int32_t* table, int64_t k0, int64_t count, int64_t h, Bf* Kc,
                 uint32_t* Vt, uint32_t* pairs) {
  const int64_t d = a.d;
  RowCursor<Bf> keys = a.rows(a.k, table, k0, h), vals = a.rows(a.v, table, k0, h);
  for (int64_t t = 0; t < KC; ++t) {
    if (t < count) std::memcpy(Kc + t * d, keys.next(), d * sizeof(Bf));
    else std::memset(Kc + t * d, 0, d * sizeof(Bf));
  }
  for (int64_t j = 0; j < KC / 2; ++j) {
    const void* x = 2 * j < count ? static_cast<const void*>(vals.next()) : kZeroRow;
    const void* y = 2 * j + 1 < count ? static_cast<const void*>(vals.next()) : kZeroRow;
    store_pair_row(x, y, d, pairs + j * d);
  }
  for (int64_t i = 0; i < d / 16; ++i) {
    const uint32_t* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = pairs + j * d + 16 * i;
    transpose16(rows, Vt + i * 256);
  }
}

// Where a row tile stands in its walk: positions and the online softmax's state, one lane per query row.
struct Rows {
  __m512 pos;   // each row's position
  __m512 m;     // reference maximum, in units of log2 (S scale log2(e)); -inf until the row sees a key
  __m512 sum;   // sum of P
};

// The keys of chunk [k0, k0 + KC) that row lanes see, as one mask per key.
void visible(const Rows& w, int64_t k0, int64_t window, __mmask16* keep) {
  for (int64_t k = 0; k < KC; ++k) {
    const __m512 kp = Vf::set1(static_cast<float>(k0 + k));
    keep[k] = _mm512_cmp_ps_mask(kp, w.pos, _CMP_LE_OQ);
    if (window > 0) keep[k] &= _mm512_cmp_ps_mask(kp, _mm512_sub_ps(w.pos, Vf::set1(float(window))), _CMP_GT_OQ);
  }
}

// O^T's four sum tiles (16 dims x 16 rows each) times each row's alpha.
void rescale_o(__m512 alpha, float* Ob) {
  _tile_stored(4, Ob, 64);
  _tile_stored(5, Ob + 256, 64);
  _tile_stored(6, Ob + 512, 64);
  _tile_stored(7, Ob + 768, 64);
  for (int r = 0; r < 64; ++r) Vf::store(Ob + r * 16, Vf::mul(Vf::load(Ob + r * 16), alpha));
  _tile_loadd(4, Ob, 64);
  _tile_loadd(5, Ob + 256, 64);
  _tile_loadd(6, Ob + 512, 64);
  _tile_loadd(7, Ob + 768, 64);
}

// One chunk's online-softmax update: S^T [KC keys][16 rows] (fp32) -> P^T as the B tile of V^T P^T, Pt[j * 16 + r]
// = the bf16 pair (P[r][2j], P[r][2j + 1]). keep == nullptr: every row sees every key of the chunk.
void softmax_chunk(const float* S, const __mmask16* keep, float c, Rows& w, uint32_t* Pt, float* Ob) {
  __m512 mx = Vf::set1(-INFINITY);
  for (int64_t k = 0; k < KC; ++k)
    mx = keep ? _mm512_mask_max_ps(mx, keep[k], mx, Vf::load(S + k * 16)) : Vf::max(mx, Vf::load(S + k * 16));
  mx = Vf::mul(mx, Vf::set1(c));
  const __mmask16 raise = _mm512_cmp_ps_mask(mx, _mm512_add_ps(w.m, Vf::set1(kLazy)), _CMP_GT_OQ);
  if (raise) {
    const __m512 m = _mm512_mask_blend_ps(raise, w.m, mx);
    const __mmask16 seen = raise & _mm512_cmp_ps_mask(w.m, Vf::set1(-INFINITY), _CMP_GT_OQ);
    if (seen) {  // rows with nothing seen yet have O = 0 and sum 0
      const __m512 alpha = _mm512_mask_blend_ps(seen, Vf::set1(1.f), exp2_finite(_mm512_mask_sub_ps(Vf::zero(), seen, w.m, m)));
      w.sum = Vf::mul(w.sum, alpha);
      rescale_o(alpha, Ob);
    }
    w.m = m;
  }
  // Rows that have seen nothing yet subtract 0 (their P is masked to 0 anyway).
  const __m512 m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(w.m, Vf::set1(-INFINITY), _CMP_EQ_OQ), w.m, Vf::zero());
  const __m512 cv = Vf::set1(c);
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t j = 0; j < KC / 2; ++j) {
    __m512 p0 = exp2_finite(_mm512_fmsub_ps(Vf::load(S + 2 * j * 16), cv, m));
    __m512 p1 = exp2_finite(_mm512_fmsub_ps(Vf::load(S + (2 * j + 1) * 16), cv, m));
    if (keep) {
      p0 = _mm512_maskz_mov_ps(keep[2 * j], p0);
      p1 = _mm512_maskz_mov_ps(keep[2 * j + 1], p1);
    }
    w.sum = Vf::add(w.sum, Vf::add(p0, p1));
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));  // p0's rows then p1's
    _mm512_storeu_si512(Pt + j * 16, _mm512_permutexvar_epi16(pairs, both));
  }
}

// Rows [16 t, 16 t + 16) over chunks [c_lo, c_hi], output dims [e0, e0 + 64): O^T in tiles 4..7, divided by the
// row sums and written to O's columns [e0, e0 + 64) (rows d apart).
void row_tile(const uint32_t* Qt, const Bf* Kc, const uint32_t* Vt, int64_t d, int64_t c_lo, int64_t c_hi,
              int64_t begin, int64_t window, float scale, int64_t e0, const float* pos, Scratch& s, float* O) {
  float* S = s.floats(0, KC * 16);
  uint32_t* Pt = s.units(3, KC / 2 * 16);
  float* Ob = s.floats(5, 64 * 16);
  __mmask16 keep[KC];
  const float c = scale * 1.44269504088896341f;
  Rows w{Vf::load(pos), Vf::set1(-INFINITY), Vf::zero()};
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t ch = c_lo; ch <= c_hi; ++ch) {
    const int64_t k0 = begin + ch * KC;
    const Bf* kc = Kc + ch * KC * d;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t q = 0; q < d / 32; ++q) {
      _tile_loadd(3, Qt + q * 256, 64);
      _tile_loadd(2, kc + q * 32, d * 2);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(2, kc + 16 * d + q * 32, d * 2);
      _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, S, 64);
    _tile_stored(1, S + 256, 64);
    // Masks only where some row's bounds cut the chunk: the causal diagonal, a window's start.
    const bool cut = k0 + KC - 1 > pos[0] || (window > 0 && k0 <= pos[TR - 1] - window);
    if (cut) visible(w, k0, window, keep);
    softmax_chunk(S, cut ? keep : nullptr, c, w, Pt, Ob);
    _tile_loadd(3, Pt, 64);
    const uint32_t* vt = Vt + ch * KC / 2 * d + e0 / 16 * 256;
    _tile_loadd(2, vt, 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(2, vt + 256, 64);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(2, vt + 512, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(2, vt + 768, 64);
    _tile_dpbf16ps(7, 2, 3);
  }
  _tile_stored(4, Ob, 64);
  _tile_stored(5, Ob + 256, 64);
  _tile_stored(6, Ob + 512, 64);
  _tile_stored(7, Ob + 768, 64);
  const __m512 inv = _mm512_div_ps(Vf::set1(1.f), w.sum);
  for (int64_t e = 0; e < 64; ++e) Vf::store(Ob + e * 16, Vf::mul(Vf::load(Ob + e * 16), inv));
  for (int64_t i = 0; i < 4; ++i) {  // O^T [16 dims][16 rows] -> O [16 rows][16 dims]
    const uint32_t* rows[16];
    for (int e = 0; e < 16; ++e) rows[e] = reinterpret_cast<const uint32_t*>(Ob + (i * 16 + e) * 16);
    alignas(64) uint32_t t[256];
    transpose16(rows, t);
    for (int r = 0; r < TR; ++r) std::memcpy(O + r * d + e0 + i * 16, t + r * 16, 64);
  }
}

void tile(const AttnView<Bf, Bf>& a, int64_t r, int64_t tok0, int64_t n, int64_t pos0, int64_t h, Scratch& s) {
  const int64_t group = a.group(), d = a.d, rows = n * group, rt = (rows + TR - 1) / TR, mp = rt * TR;
  const int32_t* table = a.tables + r * a.table_stride;
  const int64_t last = pos0 + n - 1;
  const int64_t begin = a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0;
  const int64_t chunks = (last - begin) / KC + 1, vt = KC / 2 * d;
  uint16_t* Q = reinterpret_cast<uint16_t*>(s.units(0, mp * d / 2));
  Bf* Kc = reinterpret_cast<Bf*>(s.units(1, chunks * KC * d / 2));
  uint32_t* Vt = s.units(2, chunks * vt);
  uint32_t* Qt = s.units(4, d / 32 * 256 + KC / 2 * d);
  uint32_t* pairs = Qt + d / 32 * 256;
  float* pos = s.floats(1, mp);
  float* O = s.floats(6, TR * d);
  // Queries; rows past the item are zero and sit at its last position (never all masked).
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
  // 1. Every chunk of keys the item sees, staged once for all its row tiles.
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = begin + c * KC;
    stage_chunk(a, table, k0, std::min(KC, last + 1 - k0), h, Kc + c * KC * d, Vt + c * vt, pairs);
  }
  configure_tiles();
  float* row = s.floats(7, d);
  for (int64_t t = 0; t < rt; ++t) {
    // 2. Q^T of the row tile: Qt[q * 256 + p * 16 + i] = dims (32 q + 2p, 32 q + 2p + 1) of row i.
    const uint32_t* q32 = reinterpret_cast<const uint32_t*>(Q + t * TR * d);
    for (int64_t q = 0; q < d / 32; ++q) {
      const uint32_t* qrows[16];
      for (int i = 0; i < 16; ++i) qrows[i] = q32 + i * d / 2 + q * 16;
      transpose16(qrows, Qt + q * 256);
    }
    // 3. The chunks the rows can see; 64 output dims at a time (a head size of 128 goes twice).
    const float* tp = pos + t * TR;
    const int64_t c_hi = (static_cast<int64_t>(tp[TR - 1]) - begin) / KC;
    const int64_t c_lo = a.window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(tp[0]) - a.window + 1 - begin) / KC : 0;
    for (int64_t e0 = 0; e0 < d; e0 += 64) row_tile(Qt, Kc, Vt, d, c_lo, c_hi, begin, a.window, a.scale, e0, tp, s, O);
    // 4. Back to [token, head, d] in the output's dtype.
    for (int i = 0; i < TR && t * TR + i < rows; ++i) {
      const int64_t ri = t * TR + i;
      std::memcpy(row, O + i * d, d * sizeof(float));
      store_n(row, a.out + ((tok0 + ri / group) * a.heads + h * group + ri % group) * d, d);
    }
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
  if (prefill_tile_tokens_amx(a.d, a.group()) == 0) return false;
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
