// Decode items (paged_decode.cpp's work items) on AMX tile units, for a bf16 cache and bf16 queries. Where the KV
// stays in cache the AVX512 kernel is bound by its instructions: per 16 keys and kv head it gathers row pointers,
// reloads each key once per query head and reduces 16 dot products horizontally. On the tiles, one load takes
// 16 keys straight from their block (block size a multiple of 16), and the group's query heads are one B tile
// (64 decodes x 600 tokens in L3: 1.47 -> 1.10 ms per layer; from DRAM both read ~14 GB/s, docs/results/2026-11-26-xeon-amx/NOTES.md).
//   1. stage the group's queries as B tiles (Q^T, bf16 pairs); per kv head and 16 keys from a block:
//      S^T [16 keys][group] = K Q^T on the tiles, stored key-major;
//   2. mask positions outside [first, seq_len) with -inf; softmax per query row over the key-major scores,
//      16 lanes at a time (a lane's query row repeats every group / gcd(group, 16) vectors); P rounded to bf16
//      and written query-major, as the A tiles of P V (as GPU flash attention rounds it; the AVX512-BF16 kernel
//      splits each weight into two bf16 parts instead, not yet measured on tiles);
//   3. per 32 keys: stage V with keys 2j and 2j + 1 interleaved in row j (the B tiles), zero outside the range;
//      O [group][64 dims] += P V in four sum tiles; a head size of 128 walks the values twice, 64 dims a time.
// A request's result depends only on its own keys and values (same tiles, same order whatever the batch).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "attention.h"
#include "common.h"
#include "amx.h"
#include "vec.h"

namespace kvrelay {

#if defined(KVRELAY_AMX)
namespace {

using Bf = at::BFloat16;
constexpr int64_t KT = 16;  // keys per S tile: one tile's rows, loaded from one block
constexpr int64_t KC = 32;  // keys per P V step: one A tile's width of P in bf16
// Keys prefetched ahead: 128 decodes x 600 tokens, 30 layers' caches (read from DRAM, as in serving), blocks
// shuffled: 4.2 -> 3.8 ms per layer; 64 or 128 keys, or a hint to L2 only, measured no better (AMX Xeon, 2 vCPUs).
constexpr int64_t kPfKeys = 32;

// Scores: tmm0 S^T [16 keys][group] sums, tmm1 16 keys x 32 dims, tmm2.. Q^T [16 pairs][group] per 32 dims.
void configure_scores(int64_t group, int64_t chunks) {
  TileConfig c;
  c.rows[0] = 16, c.colsb[0] = static_cast<uint16_t>(group * 4);
  c.rows[1] = 16, c.colsb[1] = 64;
  for (int64_t i = 0; i < chunks; ++i) c.rows[2 + i] = 16, c.colsb[2 + i] = static_cast<uint16_t>(group * 4);
  _tile_loadconfig(&c);
}

// P V: tmm0 P [group][32 keys], tmm1 V pairs [16][16 dims], tmm4..7 O [group][16 dims] sums.
void configure_values(int64_t group) {
  TileConfig c;
  c.rows[0] = static_cast<uint8_t>(group), c.colsb[0] = 64;
  c.rows[1] = 16, c.colsb[1] = 64;
  for (int i = 4; i < 8; ++i) c.rows[i] = static_cast<uint8_t>(group), c.colsb[i] = 64;
  _tile_loadconfig(&c);
}

// S^T for keys [k_base, end) of one kv head, 16 at a time, into sT [key - k_base][group].
template <int D>
void scores(const AttnView<Bf, Bf>& a, const int32_t* table, int64_t k_base, int64_t end, int64_t h, int64_t group,
            const uint32_t* qt, float* sT) {
  constexpr int chunks = D / 32;
  const int64_t ts = a.token_stride(), qstride = group * 4;
  _tile_loadd(2, qt, qstride);
  _tile_loadd(3, qt + 16 * group, qstride);
  if constexpr (chunks == 4) {
    _tile_loadd(4, qt + 32 * group, qstride);
    _tile_loadd(5, qt + 48 * group, qstride);
  }
  for (int64_t k0 = k_base; k0 < end; k0 += KT) {
    const Bf* kp = a.row(a.k, table, k0, h);
    if (k0 + kPfKeys < end) {
      const Bf* nx = a.row(a.k, table, k0 + kPfKeys, h);
      for (int64_t r = 0; r < KT; ++r) prefetch(nx + r * ts, D * 2);
    }
    _tile_zero(0);
    _tile_loadd(1, kp, ts * 2);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, kp + 32, ts * 2);
    _tile_dpbf16ps(0, 1, 3);
    if constexpr (chunks == 4) {
      _tile_loadd(1, kp + 64, ts * 2);
      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(1, kp + 96, ts * 2);
      _tile_dpbf16ps(0, 1, 5);
    }
    _tile_stored(0, sT + (k0 - k_base) * group, qstride);
  }
}

// Softmax of each query row over key-major scores sT [npad][group] (masked entries -inf), written query-major
// in bf16: P[g * npad + j]. Lane l of vector i holds row (16 i + l) % group, a pattern of `period` vectors.
void softmax_key_major(float* sT, int64_t npad, int64_t group, float scale, uint16_t* P) {
  const int64_t period = group / std::gcd<int64_t>(group, 16), nv = npad * group / 16;
  __m512 mx[16], sum[16];
  for (int64_t i = 0; i < period; ++i) mx[i] = Vf::set1(-INFINITY), sum[i] = Vf::zero();
  for (int64_t i = 0; i < nv; ++i) mx[i % period] = Vf::max(mx[i % period], Vf::load(sT + 16 * i));
  float row_max[16], row_inv[16];
  std::fill(row_max, row_max + group, -INFINITY);
  alignas(64) float lanes[16 * 16];
  for (int64_t i = 0; i < period; ++i) Vf::store(lanes + 16 * i, mx[i]);
  for (int64_t j = 0; j < 16 * period; ++j) row_max[j % group] = std::max(row_max[j % group], lanes[j]);
  for (int64_t i = 0; i < period; ++i) {
    for (int l = 0; l < 16; ++l) lanes[16 * i + l] = row_max[(16 * i + l) % group] * scale;
    mx[i] = Vf::load(lanes + 16 * i);
  }
  const __m512 sc = Vf::set1(scale);
  for (int64_t i = 0; i < nv; ++i) {
    const __m512 e = Vf::exp_neg(Vf::sub(Vf::mul(Vf::load(sT + 16 * i), sc), mx[i % period]));
    Vf::store(sT + 16 * i, e);
    sum[i % period] = Vf::add(sum[i % period], e);
  }
  std::fill(row_inv, row_inv + group, 0.f);
  for (int64_t i = 0; i < period; ++i) Vf::store(lanes + 16 * i, sum[i]);
  for (int64_t j = 0; j < 16 * period; ++j) row_inv[j % group] += lanes[j];
  for (int64_t g = 0; g < group; ++g) row_inv[g] = 1.f / row_inv[g];
  // Query-major: P[g][j] = sT[j][g] / sum_g, 16 keys per gather.
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(group)));
  for (int64_t g = 0; g < group; ++g) {
    const __m512 inv = Vf::set1(row_inv[g]);
    for (int64_t j = 0; j < npad; j += 32) {
      const __m512 x = Vf::mul(_mm512_i32gather_ps(idx, sT + j * group + g, 4), inv);
      const __m512 y = Vf::mul(_mm512_i32gather_ps(idx, sT + (j + 16) * group + g, 4), inv);
      _mm512_storeu_si512(P + g * npad + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(y, x)));
    }
  }
}

// Values [k0, k0 + 32) of kv head h, dims [e0, e0 + 64), as B tiles: Vv[j * 64 + e] = the pair (V[2j][e], V[2j+1][e]);
// rows outside [lo, hi) are zero.
void stage_values(const AttnView<Bf, Bf>& a, const int32_t* table, int64_t k0, int64_t lo, int64_t hi, int64_t h,
                  int64_t e0, uint32_t* Vv) {
  RowCursor<Bf> vals = a.rows(a.v, table, std::max(k0, lo), h);  // the rows inside are consecutive
  auto row = [&](int64_t pos) -> const void* {
    return pos < lo || pos >= hi ? static_cast<const void*>(kZeroRow) : vals.next() + e0;
  };
  for (int64_t j = 0; j < KC / 2; ++j) {
    const void* x = row(k0 + 2 * j);
    store_pair_row(x, row(k0 + 2 * j + 1), 64, Vv + j * 64);
  }
}

// stage_values for a chunk wholly inside the range: its two runs of 16 keys each lie in one block (k0 and the
// block size multiples of 16), so each run is one table lookup and a fixed stride, with no per-key bookkeeping.
void stage_values_full(const Bf* const run[2], int64_t ts, uint32_t* Vv) {
  for (int64_t j = 0; j < KC / 2; ++j) {
    const Bf* x = run[j / 8] + (2 * j % 16) * ts;
    store_pair_row(x, x + ts, 64, Vv + j * 64);
  }
}

template <int D>
void item(const AttnView<Bf, Bf>& a, const int32_t* table, int64_t token, int64_t seq_len, int64_t first,
          int64_t h0, int64_t nh, Scratch& s) {
  const int64_t group = a.group(), k_base = first / KC * KC, npad = (seq_len - k_base + KC - 1) / KC * KC;
  const int64_t rows = nh * group, ts = a.token_stride();
  float* sT = s.floats(0, npad * group);
  uint16_t* P = reinterpret_cast<uint16_t*>(s.units(0, nh * group * npad / 2));
  uint32_t* qt = s.units(1, D / 2 * group);
  uint32_t* Vv = s.units(2, KC / 2 * 64);
  float* outf = s.floats(1, rows * D);
  const Bf* q = a.q + token * a.q_stride + h0 * group * D;
  // 1-2. Scores and P, one kv head at a time.
  configure_scores(group, D / 32);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const uint32_t* qh = reinterpret_cast<const uint32_t*>(q + hh * group * D);
    for (int64_t p = 0; p < D / 2; ++p)
      for (int64_t g = 0; g < group; ++g) qt[p * group + g] = qh[g * (D / 2) + p];
    scores<D>(a, table, k_base, seq_len, h0 + hh, group, qt, sT);
    for (int64_t j = 0; j < first - k_base; ++j)
      for (int64_t g = 0; g < group; ++g) sT[j * group + g] = -INFINITY;
    for (int64_t j = seq_len - k_base; j < npad; ++j)
      for (int64_t g = 0; g < group; ++g) sT[j * group + g] = -INFINITY;
    softmax_key_major(sT, npad, group, a.scale, P + hh * group * npad);
  }
  // 3. O = P V.
  configure_values(group);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const uint16_t* ph = P + hh * group * npad;
    for (int64_t e0 = 0; e0 < D; e0 += 64) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t k0 = k_base; k0 < seq_len; k0 += KC) {
        for (int64_t pos = k0 + kPfKeys; pos < std::min(seq_len, k0 + kPfKeys + KC); pos += KT) {
          const Bf* r = a.row(a.v, table, pos, h0 + hh) + e0;
          for (int64_t t = 0; t < std::min(KT, seq_len - pos); ++t) prefetch(r + t * ts, 128);
        }
        if (k0 >= first && k0 + KC <= seq_len) {
          const Bf* run[2] = {a.row(a.v, table, k0, h0 + hh) + e0, a.row(a.v, table, k0 + KT, h0 + hh) + e0};
          stage_values_full(run, ts, Vv);
        } else {
          stage_values(a, table, k0, first, seq_len, h0 + hh, e0, Vv);
        }
        _tile_loadd(0, ph + (k0 - k_base), npad * 2);
        _tile_loadd(1, Vv, 256);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, Vv + 16, 256);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(1, Vv + 32, 256);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, Vv + 48, 256);
        _tile_dpbf16ps(7, 0, 1);
      }
      float* o = outf + hh * group * D + e0;
      _tile_stored(4, o, D * 4);
      _tile_stored(5, o + 16, D * 4);
      _tile_stored(6, o + 32, D * 4);
      _tile_stored(7, o + 48, D * 4);
    }
  }
  _tile_release();
  store_n(outf, a.out + (token * a.heads + h0 * group) * D, rows * D);
}

}  // namespace

bool decode_item_amx(const AttnView<Bf, Bf>& a, const int32_t* table, int64_t token, int64_t seq_len, int64_t first,
                     int64_t h0, int64_t nh, Scratch& s) {
  if ((a.d != 64 && a.d != 128) || a.bs % KT != 0 || a.group() > 16 || !amx_permitted()) return false;
  if (a.d == 64) item<64>(a, table, token, seq_len, first, h0, nh, s);
  else item<128>(a, table, token, seq_len, first, h0, nh, s);
  return true;
}

#else

bool decode_item_amx(const AttnView<at::BFloat16, at::BFloat16>&, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                     int64_t, Scratch&) {
  return false;
}

#endif

}  // namespace kvrelay
