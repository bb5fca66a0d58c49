// Prefill tiles (paged_prefill.cpp's work items) on AMX tile units, for a bf16 cache and bf16 queries: the two
// matrix products of flash attention on the tiles, the online softmax in AVX512. On an AMX Xeon the tiles do a
// 16 x 16 x 32 product per instruction, so the AVX512-BF16 register tiles' dot products stop being the cost.
//   1. stage the item's query rows (token, query head of the group) row-major, zero past the end;
//   2. per chunk of KC = 32 keys: stage K^T as bf16 pairs (the B tiles of Q K^T) and V with keys 2j and 2j + 1
//      interleaved in row j (the B tiles of P V); then per 16 query rows: S = Q K^T on the tiles, scale, mask
//      (causal, window, past the end) with -inf, per row: new max, rescale factor, P = exp(S - max) rounded to
//      bf16 (as the AVX512-BF16 path and GPU flash attention round it), running sum; O = alpha O + P V;
//   3. write O / sum in the output's dtype.
// A row's result does not depend on the other rows of its item (same chunks, same order).
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

using Bf = at::BFloat16;

// Chunk keys [k0, k0 + count) of kv head h: Kt[(c * 2 + half) * 256 + p * 16 + t] = the pair (2p, 2p + 1) of
// dims [32c, 32c + 32) of key 16 half + t; Vv[j * d + e] = (V[2j][e], V[2j + 1][e]). Zero past `count`.
void stage_chunk(const AttnView<Bf, Bf>& a, const int32_t* table, int64_t k0, int64_t count, int64_t h, uint32_t* Kt,
                 uint32_t* Vv) {
  const int64_t d = a.d, chunks = d / 32;
  std::fill(Kt, Kt + chunks * 2 * 256, 0u);
  RowCursor<Bf> keys = a.rows(a.k, table, k0, h), vals = a.rows(a.v, table, k0, h);
  for (int64_t t = 0; t < count; ++t) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(keys.next());
    for (int64_t c = 0; c < chunks; ++c) {
      uint32_t* dst = Kt + (c * 2 + t / 16) * 256 + t % 16;
      for (int64_t p = 0; p < 16; ++p) dst[p * 16] = k[c * 16 + p];
    }
  }
  const __m512i zv = _mm512_setzero_si512();
  for (int64_t j = 0; j < KC / 2; ++j) {
    const Bf* x = 2 * j < count ? vals.next() : nullptr;
    const Bf* y = 2 * j + 1 < count ? vals.next() : nullptr;
    for (int64_t e = 0; e < d; e += 32) {
      const __m512i xv = x ? _mm512_loadu_si512(x + e) : zv, yv = y ? _mm512_loadu_si512(y + e) : zv;
      _mm512_storeu_si512(Vv + j * d + e, interleave_pairs(xv, yv, 0));
      _mm512_storeu_si512(Vv + j * d + e + 16, interleave_pairs(xv, yv, 1));
    }
  }
}

// One chunk's online-softmax update of 16 rows: S (fp32, KC per row) -> P (bf16, KC per row), m, l, alpha.
void softmax_rows(const float* S, uint16_t* P, const float* pos, int64_t k0, int64_t count, int64_t window,
                  float scale, float* m, float* l, float* alpha) {
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 kp0 = _mm512_add_ps(lane, Vf::set1(static_cast<float>(k0)));
  const __m512 kp1 = _mm512_add_ps(kp0, Vf::set1(16.f));
  const __m512 end = Vf::set1(static_cast<float>(k0 + count));
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
    const float mx = std::max(m[r], Vf::hmax(Vf::max(s0, s1)));
    const float ms = mx == -INFINITY ? 0.f : mx;  // nothing visible yet: keep exp finite
    const __m512 p0 = Vf::exp_neg(Vf::sub(s0, Vf::set1(ms))), p1 = Vf::exp_neg(Vf::sub(s1, Vf::set1(ms)));
    const __m512i pb = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));  // p0 in 0..15, p1 in 16..31
    _mm512_storeu_si512(P + r * KC, pb);
    const float al = m[r] == -INFINITY ? 0.f : std::exp(m[r] - ms);
    alpha[r] = al;
    l[r] = l[r] * al + _mm512_reduce_add_ps(Vf::add(p0, p1));
    m[r] = mx;
  }
}

// O[16 rows][d] = alpha O + P V for one row tile; P is in tile 2's source `P`.
void pv_rows(const uint16_t* P, const uint32_t* Vv, int64_t d, float* O, float* Oc, const float* alpha) {
  _tile_loadd(2, P, KC * 2);
  for (int64_t e0 = 0; e0 < d; e0 += 64) {  // four 16-element column tiles at a time
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(3, Vv + e0, d * 4);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(3, Vv + e0 + 16, d * 4);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(3, Vv + e0 + 32, d * 4);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(3, Vv + e0 + 48, d * 4);
    _tile_dpbf16ps(7, 2, 3);
    _tile_stored(4, Oc, 64 * 4);
    _tile_stored(5, Oc + 16, 64 * 4);
    _tile_stored(6, Oc + 32, 64 * 4);
    _tile_stored(7, Oc + 48, 64 * 4);
    for (int r = 0; r < TR; ++r) {
      const __m512 al = Vf::set1(alpha[r]);
      float* o = O + r * d + e0;
      for (int e = 0; e < 64; e += 16) Vf::store(o + e, Vf::fma(Vf::load(o + e), al, Vf::load(Oc + r * 64 + e)));
    }
  }
}

void tile(const AttnView<Bf, Bf>& a, int64_t r, int64_t tok0, int64_t n, int64_t pos0, int64_t h, Scratch& s) {
  const int64_t group = a.group(), d = a.d, rows = n * group, rt = (rows + TR - 1) / TR, mp = rt * TR;
  const int32_t* table = a.tables + r * a.table_stride;
  uint16_t* Q = reinterpret_cast<uint16_t*>(s.units(0, mp * d / 2));
  uint32_t* Kt = s.units(1, d / 32 * 2 * 256);
  uint32_t* Vv = s.units(2, KC / 2 * d);
  uint16_t* P = reinterpret_cast<uint16_t*>(s.units(3, TR * KC / 2));
  float* S = s.floats(0, TR * KC);
  float* O = s.floats(1, mp * d);
  float* m = s.floats(2, mp);
  float* l = s.floats(3, mp);
  float* alpha = s.floats(4, TR);
  float* Oc = s.floats(5, TR * 64);
  float* pos = s.floats(6, mp);
  // 1. Queries; rows past the item are zero and sit at its last position (never all masked).
  for (int64_t i = 0; i < mp; ++i) {
    const int64_t j = std::min(i / group, n - 1);
    pos[i] = static_cast<float>(pos0 + j);
    m[i] = -INFINITY;
    l[i] = 0.f;
    uint16_t* dst = Q + i * d;
    if (i >= rows) {
      std::fill(dst, dst + d, uint16_t(0));
      continue;
    }
    std::memcpy(dst, a.q + (tok0 + j) * a.q_stride + (h * group + i % group) * d, d * sizeof(Bf));
  }
  std::fill(O, O + mp * d, 0.f);
  configure_tiles();
  const int64_t last = pos0 + n - 1;
  const int64_t begin = a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0;
  for (int64_t k0 = begin; k0 <= last; k0 += KC) {
    // 2. One chunk of keys, then each row tile over it.
    const int64_t count = std::min(KC, last + 1 - k0);
    stage_chunk(a, table, k0, count, h, Kt, Vv);
    for (int64_t t = 0; t < rt; ++t) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = 0; c < d / 32; ++c) {
        _tile_loadd(2, Q + t * TR * d + c * 32, d * 2);
        _tile_loadd(3, Kt + (c * 2) * 256, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, Kt + (c * 2 + 1) * 256, 64);
        _tile_dpbf16ps(1, 2, 3);
      }
      _tile_stored(0, S, KC * 4);
      _tile_stored(1, S + 16, KC * 4);
      softmax_rows(S, P, pos + t * TR, k0, count, a.window, a.scale, m + t * TR, l + t * TR, alpha);
      pv_rows(P, Vv, d, O + t * TR * d, Oc, alpha);
    }
  }
  _tile_release();
  // 3. out = O / sum, back to [token, head, d].
  float* row = s.floats(7, d);
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = 1.f / l[i];
    for (int64_t e = 0; e < d; ++e) row[e] = O[i * d + e] * inv;
    store_n(row, a.out + ((tok0 + i / group) * a.heads + h * group + i % group) * d, d);
  }
}

}  // namespace

bool prefill_item_amx(const AttnView<at::BFloat16, at::BFloat16>& a, int64_t r, int64_t tok0, int64_t n,
                      int64_t pos0, int64_t h, Scratch& s) {
  if (a.d % 64 != 0 || !amx_permitted()) return false;
  tile(a, r, tok0, n, pos0, h, s);
  return true;
}

#else

bool prefill_item_amx(const AttnView<at::BFloat16, at::BFloat16>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                      Scratch&) {
  return false;
}

#endif

}  // namespace kvrelay
