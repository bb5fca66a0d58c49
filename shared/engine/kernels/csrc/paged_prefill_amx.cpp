// Prefill items (paged_prefill.cpp's work items) on AMX tile units, for a bf16 cache and bf16 queries: the two
// matrix products of flash attention on the tiles, the online softmax in AVX512. On an AMX Xeon the tiles do a
// 16 x 16 x 32 product per instruction, so the AVX512-BF16 register tiles' dot products stop being the cost.
//   1. stage the item's query rows (token, query head of the group) row-major, zero past the end;
//   2. stage every chunk of KC = 32 keys the item sees, once for all its row tiles: K^T as bf16 pairs (the B
//      tiles of Q K^T, by 16 x 16 transposes) and V with keys 2j and 2j + 1 interleaved in row j (the B tiles
//      of P V);
//   3. per 16 query rows, over the chunks they can see: S = Q K^T on the tiles, scale, mask (causal, window,
//      past the end) with -inf, P = exp(S - m) rounded to bf16 (as the AVX512-BF16 path and GPU flash attention
//      round it), O += P V in four sum tiles that stay on the tile unit for the whole walk. A row's reference
//      maximum m moves only when a chunk's exceeds it by more than kLazy, and only then is O rescaled;
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
constexpr float kLazy = 8.f;  // how far a row's running maximum may rise before O is rescaled (e^8 ~ 3e3)

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

// One chunk's online-softmax update of 16 rows: S (fp32, KC per row) -> P (bf16, KC per row). A row's reference
// maximum m moves only when the chunk's exceeds it by more than kLazy, so that O, which stays in its sum tiles,
// seldom needs rescaling (P <= e^kLazy, well inside bf16 and fp32). The row sums are kept per lane (lsum, 16 per
// row) and reduced once at the end. Returns whether some row's O must be rescaled by alpha.
bool softmax_rows(const float* S, uint16_t* P, const float* pos, int64_t k0, int64_t count, int64_t window,
                  float scale, float* m, float* lsum, float* alpha) {
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 kp0 = _mm512_add_ps(lane, Vf::set1(static_cast<float>(k0)));
  const __m512 kp1 = _mm512_add_ps(kp0, Vf::set1(16.f));
  const __m512 end = Vf::set1(static_cast<float>(k0 + count));
  bool rescale = false;
  for (int r = 0; r < TR; ++r) {
    const __m512 pr = Vf::set1(pos[r]);
    __m512 s0 = Vf::mul(Vf::load(S + r * KC), Vf::set1(scale));
    __m512 s1 = Vf::mul(Vf::load(S + r * KC + 16), Vf::set1(scale));
    s0 = Vf::keep_le(s0, kp0, pr);  // causal
    s1 = Vf::keep_le(s1, kp1, pr);
    s0 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(kp0, end, _CMP_LT_OQ), Vf::set1(-INFINITY), s0);
    s1 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(kp1, end, _CMP_LT_OQ), Vf::set1(-INFINITY), s1);
    if (window > 0) {
      const __m512 lo = Vf::set1(pos[r] - static_cast<float>(window));
      s0 = Vf::keep_gt(s0, kp0, lo);
      s1 = Vf::keep_gt(s1, kp1, lo);
    }
    const float mx = Vf::hmax(Vf::max(s0, s1));
    alpha[r] = 1.f;
    if (mx > m[r] + kLazy || (m[r] == -INFINITY && mx > -INFINITY)) {
      if (m[r] != -INFINITY) {  // rows with nothing seen yet have O = 0 and sum 0
        alpha[r] = std::exp(m[r] - mx);
        Vf::store(lsum + r * 16, Vf::mul(Vf::load(lsum + r * 16), Vf::set1(alpha[r])));
        rescale = true;
      }
      m[r] = mx;
    }
    const float ms = m[r] == -INFINITY ? 0.f : m[r];  // nothing visible yet: keep exp finite
    const __m512 p0 = exp16(Vf::sub(s0, Vf::set1(ms))), p1 = exp16(Vf::sub(s1, Vf::set1(ms)));  // up to e^kLazy
    _mm512_storeu_si512(P + r * KC, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));  // p0 in 0..15
    Vf::store(lsum + r * 16, Vf::add(Vf::load(lsum + r * 16), Vf::add(p0, p1)));
  }
  return rescale;
}

// The four O sum tiles (16 rows x 64 dims) times each row's alpha.
void rescale_o(const float* alpha, float* Ob) {
  _tile_stored(4, Ob, 256);
  _tile_stored(5, Ob + 16, 256);
  _tile_stored(6, Ob + 32, 256);
  _tile_stored(7, Ob + 48, 256);
  for (int r = 0; r < TR; ++r)
    for (int e = 0; e < 64; e += 16) Vf::store(Ob + r * 64 + e, Vf::mul(Vf::load(Ob + r * 64 + e), Vf::set1(alpha[r])));
  _tile_loadd(4, Ob, 256);
  _tile_loadd(5, Ob + 16, 256);
  _tile_loadd(6, Ob + 32, 256);
  _tile_loadd(7, Ob + 48, 256);
}

// Rows [16 t, 16 t + 16) over the staged chunks, for output dims [e0, e0 + 64): O in tiles 4..7, written to O's
// columns [e0, e0 + 64) (rows d apart); Ob is the rescale's scratch.
void row_tile(const uint16_t* Q, const uint32_t* Kt, const uint32_t* Vv, int64_t d, int64_t c_lo, int64_t c_hi,
              int64_t begin, int64_t last, int64_t window, float scale, int64_t e0, const float* pos, float* m,
              float* lsum, Scratch& s, float* Ob, float* O) {
  float* S = s.floats(0, TR * KC);
  uint16_t* P = reinterpret_cast<uint16_t*>(s.units(3, TR * KC / 2));
  float* alpha = s.floats(4, TR);
  const int64_t kt = d / 32 * 2 * 256, vv = KC / 2 * d;  // one chunk's staged K^T and V
  for (int r = 0; r < TR; ++r) m[r] = -INFINITY;
  std::fill(lsum, lsum + TR * 16, 0.f);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t c = c_lo; c <= c_hi; ++c) {
    const int64_t k0 = begin + c * KC;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t q = 0; q < d / 32; ++q) {
      _tile_loadd(2, Q + q * 32, d * 2);
      _tile_loadd(3, Kt + c * kt + (q * 2) * 256, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(3, Kt + c * kt + (q * 2 + 1) * 256, 64);
      _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, S, KC * 4);
    _tile_stored(1, S + 16, KC * 4);
    if (softmax_rows(S, P, pos, k0, std::min(KC, last + 1 - k0), window, scale, m, lsum, alpha)) rescale_o(alpha, Ob);
    _tile_loadd(2, P, KC * 2);
    const uint32_t* v = Vv + c * vv + e0;
    _tile_loadd(3, v, d * 4);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(3, v + 16, d * 4);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(3, v + 32, d * 4);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(3, v + 48, d * 4);
    _tile_dpbf16ps(7, 2, 3);
  }
  _tile_stored(4, O + e0, d * 4);
  _tile_stored(5, O + e0 + 16, d * 4);
  _tile_stored(6, O + e0 + 32, d * 4);
  _tile_stored(7, O + e0 + 48, d * 4);
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
  float* m = s.floats(2, TR);
  float* lsum = s.floats(3, TR * 16);
  float* Ob = s.floats(5, TR * 64);
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
  float* row = s.floats(7, d);
  for (int64_t t = 0; t < rt; ++t) {
    // 3. Per row tile, the chunks its rows can see; 64 output dims at a time (a head size of 128 goes twice).
    const float* tp = pos + t * TR;
    const int64_t c_hi = (static_cast<int64_t>(tp[TR - 1]) - begin) / KC;
    const int64_t c_lo = a.window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(tp[0]) - a.window + 1 - begin) / KC : 0;
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
      row_tile(Q + t * TR * d, Kt, Vv, d, c_lo, c_hi, begin, last, a.window, a.scale, e0, tp, m, lsum, s, Ob, O);
    }
    // 4. out = O / sum, back to [token, head, d].
    for (int i = 0; i < TR && t * TR + i < rows; ++i) {
      const int64_t ri = t * TR + i;
      const float inv = 1.f / Vf::hsum(Vf::load(lsum + i * 16));
      for (int64_t e = 0; e < d; ++e) row[e] = O[i * d + e] * inv;
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
