// y = x W^T (+ b) for the few rows of a decode step (up to ~100), and the greedy argmax of it for the LM head
// without writing the logits. Written once against the machine's fp32 vector (vec.h: 16 lanes with AVX512, 8
// with AVX2 + FMA).
//
// Why not oneDNN here: at these row counts a model's weights (hundreds of MB) stream from DRAM every step and
// oneDNN's GEMM waits for them instead of computing (cold weights, 64 rows: 21.8 ms per 30 SmolLM2 layers where
// the math needs 13.4 and the stream 7), and each call costs ~12 us of dispatch. This kernel walks the weight
// in panels of NR x L output columns, prefetching the next panel into L2 while the current one computes.
//
// Layout (pack_weight): the weight as column blocks of L outputs (one vector), each [units of K][L lanes]: fp32
// numbers, or bf16 pairs (k, k + 1) for AVX512-BF16 dot products. A row's result depends on nothing but that row (the
// sums run over K in one fixed order), so a decode's logits are the same alone, batched, or beside drafts.
#pragma GCC optimize("fp-contract=fast")

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "amx.h"
#include "api.h"
#include "common.h"
#include "vec.h"

namespace kvrelay {

#if defined(KVRELAY_AVX512) || defined(KVRELAY_AVX2)
namespace {

using V = Vf::R;
constexpr int L = Vf::W;  // output columns per block (one vector)
// A register tile of MR rows x NR column blocks: its sums, NR weight vectors and one broadcast must fit in the
// register file (32 vectors with AVX512, 16 with AVX2: 4 x 3 sums + 3 + 1).
constexpr int NR = L == 16 ? 4 : 3;
constexpr int MR = L == 16 ? 6 : 4;

struct F32 {
  using U = float;
  using B = V;
  static B vload(const U* p) { return Vf::load(p); }
  static B bcast(const U* p) { return Vf::set1(*p); }
  static V dot(V acc, B a, B b) { return Vf::fma(a, b, acc); }
};
#if defined(KVRELAY_AVX512BF16)
struct Pairs {
  using U = uint32_t;
  using B = __m512i;
  static B vload(const U* p) { return _mm512_loadu_si512(p); }
  static B bcast(const U* p) { return _mm512_set1_epi32(static_cast<int>(*p)); }
  static __m512 dot(__m512 acc, B a, B b) { return dot_pairs(acc, a, b); }
};
#endif

// acc[i][j] = sum over units u of x[i][u] w_j[u] for mr rows and nr column blocks; the next panel's same units
// are prefetched alongside when `next` is set.
template <class M, int mr, int nr>
inline void tile(const typename M::U* x, int64_t xs, const typename M::U* w, int64_t units, const typename M::U* next,
                 int64_t pf_phase, int64_t pf_every, V (&out)[MR][NR]) {
  V acc[mr][nr];  // local, so the compiler keeps them in registers (the out array would be memory)
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = Vf::zero();
  const int64_t bstride = units * L;
  for (int64_t u = 0; u < units; ++u) {
    typename M::B b[nr];
    for (int j = 0; j < nr; ++j) b[j] = M::vload(w + j * bstride + u * L);
    if (next != nullptr && u % pf_every == pf_phase)
      for (int j = 0; j < nr; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * bstride + u * L), _MM_HINT_T1);
    for (int i = 0; i < mr; ++i) {
      const typename M::B a = M::bcast(x + i * xs + u);
      for (int j = 0; j < nr; ++j) acc[i][j] = M::dot(acc[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = acc[i][j];
}

// tile<M, mr, nr> for run-time mr <= MR and nr <= NR: each count is matched from the largest down.
template <class M, int nr, int mr = MR>
inline void tile_rows(int rows, const typename M::U* x, int64_t xs, const typename M::U* w, int64_t units,
                      const typename M::U* next, int64_t phase, int64_t every, V (&acc)[MR][NR]) {
  if constexpr (mr > 1) {
    if (rows < mr) return tile_rows<M, nr, mr - 1>(rows, x, xs, w, units, next, phase, every, acc);
  }
  tile<M, mr, nr>(x, xs, w, units, next, phase, every, acc);
}

template <class M, int nr = NR>
inline void tile_any(int mr, int blocks, const typename M::U* x, int64_t xs, const typename M::U* w, int64_t units,
                     const typename M::U* next, int64_t phase, int64_t every, V (&acc)[MR][NR]) {
  if constexpr (nr > 1) {
    if (blocks < nr) return tile_any<M, nr - 1>(mr, blocks, x, xs, w, units, next, phase, every, acc);
  }
  tile_rows<M, nr>(mr, x, xs, w, units, next, phase, every, acc);
}

// Panel width in column blocks: of NR, NR - 1 and NR - 2, the one whose panels give the busiest thread the
// fewest blocks (the wider on a tie). 36 or 60 blocks (SmolLM2's o/down and qkv projections) make 9 or 15 panels
// of 4, so one of 2 threads ends each call with a whole panel alone; panels of 3 split evenly (32 rows, 30 layers
// and the LM head, cold weights, medians of 3 alternated runs: 22.6 -> 21.2 ms, 25 rows 18.0 -> 17.3, 64 rows
// 40.3 -> 38.5; AMD EPYC Zen 5, 2 threads).
inline int panel_width(int64_t blocks, int64_t threads) {
  int best = NR;
  int64_t best_load = INT64_MAX;
  for (int w = NR; w >= std::max(1, NR - 2); --w) {
    const int64_t panels = (blocks + w - 1) / w, load = (panels + threads - 1) / threads * w;
    if (load < best_load) best = w, best_load = load;
  }
  return best;
}

// Calls visit(row0, mr, block0, nr, acc) for every register tile. Panels of up to NR column blocks are handed out
// one at a time, so a thread the OS preempts (a serving process shares these cores) is covered by the other
// instead of stalling it at the end; each thread prefetches into L2, spread over the current panel's row tiles
// (a 6-row tile alone is too short to cover the fetch), the panel it will most likely take next. The rows are
// split evenly over the fewest tiles of at most MR rows (32 rows: 6+6+5+5+5+5, not 6x5+2): a tile of one or two
// rows keeps too few sums in flight to fill the FMA units (32 rows, 30 SmolLM2 layers and the LM head, cold
// weights: 23.4 -> 22.6 ms; 25 rows: 20.2 -> 18.4 ms; AMD EPYC Zen 5, 2 threads). A row's sums do not depend on
// which tile it is in.
template <class M, class Visit>
void for_tiles(const typename M::U* x, int64_t rows, int64_t xs, const typename M::U* w, int64_t units,
               int64_t blocks, Visit&& visit) {
  const int team = std::max(1, at::get_num_threads());
  const int pw = panel_width(blocks, team);
  const int64_t panels = (blocks + pw - 1) / pw;
  const int threads = std::max(1, std::min<int>(team, static_cast<int>(panels)));
  const int64_t tiles = (rows + MR - 1) / MR;
#pragma omp parallel num_threads(threads)
  {
    V acc[MR][NR];
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t b0 = p * pw;
      const int nr = static_cast<int>(std::min<int64_t>(pw, blocks - b0));
      const typename M::U* wp = w + b0 * units * L;
      const typename M::U* next = p + threads < panels ? wp + threads * pw * units * L : nullptr;
      for (int64_t i = 0, r0 = 0; i < tiles; ++i) {
        const int mr = static_cast<int>(rows / tiles + (i < rows % tiles));
        tile_any<M>(mr, nr, x + r0 * xs, xs, wp, units, next, i, tiles, acc);
        visit(r0, mr, b0, nr, acc);
        r0 += mr;
      }
    }
  }
}

#if defined(KVRELAY_AMX)
// Rows per work item of the AMX walk: 64 or 32 measured slower from 128 rows up (each item walks its group's
// weights again).
constexpr int64_t kAmxRowBlock = 128;

// A 32 x 32 block of sums whose rows are still to be handed on: the tiles compute the next block meanwhile, and
// a few of these rows go out between each of its K steps, so the vector units convert and store while the tile
// unit multiplies. One after the other, in a C model of this loop (AMX Xeon, 2 vCPUs): 2048 x 576 -> 3072 ran at
// ~2,460 GFLOP/s and ~3,400 with no stores at all; overlapped 2,690. 1024 x 1536 -> 576: 3,050 -> 3,620.
struct PendingBlock {
  alignas(64) float sums[32 * 32];
  int64_t m0 = 0, end = 0, next = 0, b0 = 0;
  int nb = 0;

  void take(int64_t m0_, int64_t end_, int64_t b0_, int nb_) {
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + 16, 128);
    _tile_stored(2, sums + 16 * 32, 128);
    _tile_stored(3, sums + 16 * 32 + 16, 128);
    m0 = m0_, end = end_, next = m0_, b0 = b0_, nb = nb_;
  }
  // Hands on up to n more rows: block(m0, row, row_end, b0, nb, sums), sums' row 0 being row m0.
  template <class Block>
  void emit(int64_t n, Block& block) {
    if (next >= end) return;
    const int64_t stop = std::min(end, next + n);
    block(m0, next, stop, b0, nb, static_cast<const float*>(sums));
    next = stop;
  }
};

// x W^T on AMX tiles, for bf16 pairs with K a multiple of 32 (the packed layout's [16 units][16 lanes] slices are
// the B tiles as they are): 32 rows x 2 column blocks at a time in four 16 x 16 sum tiles over the whole of K,
// handed to block(m0, row, row_end, b0, nb, sums) a few rows at a time (PendingBlock) as fp32 [32][32] from row
// m0 (column blocks b0 .. b0 + nb - 1); a thread hands on its blocks in the order it computed them.
// Each thread owns one group of consecutive panels, and work items are (row block, group), row blocks outer:
// a thread writes its share of each output row as one run, where handing out single panels wrote 64-byte pieces
// of every row a panel at a time. With gemm's direct 64-byte stores, 30 SmolLM2 layers, cold weights (AMX Xeon,
// 2 vCPUs): 16 rows 8.4-9.2 -> 7.6-8.3 ms, 64 rows 11.6-12.3 -> 10.5-10.6, 128 rows 18.4 -> 15.3-15.8. The next
// panel is prefetched into L2 on the first row block. Rows past the last whole tile of 16 are read from a
// zero-padded copy of just those rows: copying every row there (single-threaded, before the walk) held 1,025 to
// 1,167 rows at 1,170-1,650 GFLOP/s against 2,100-2,410 at multiples of 16 (AMX Xeon, 2 vCPUs). A row's sums do
// not depend on the rows beside it.
template <class Block>
void for_blocks_amx(const uint32_t* x, int64_t rows, int64_t xs, const uint32_t* w, int64_t units, int64_t blocks,
                    Block&& block) {
  const int64_t whole = rows / 16 * 16;
  std::vector<uint32_t> tail;
  if (whole != rows) {
    tail.assign(16 * units, 0u);
    for (int64_t r = whole; r < rows; ++r)
      std::memcpy(tail.data() + (r - whole) * units, x + r * xs, units * sizeof(uint32_t));
  }
  // The 16 rows from m0 (a multiple of 16), in x or the padded tail, and their stride in bytes.
  const auto rows_at = [&](int64_t m0) { return m0 < whole ? x + m0 * xs : tail.data(); };
  const auto stride = [&](int64_t m0) { return (m0 < whole ? xs : units) * 4; };
  const int64_t panels = (blocks + 1) / 2, chunks = units / 16, bs = units * L;  // bs: one block's units
  const int64_t groups = std::min<int64_t>(panels, std::max(1, at::get_num_threads()));
  const int64_t items = groups * ((rows + kAmxRowBlock - 1) / kAmxRowBlock);
  const int64_t per_step = (32 + chunks - 1) / chunks;  // rows handed on per K step: all 32 by the last step
#pragma omp parallel num_threads(static_cast<int>(groups))
  {
    configure_tiles();
    PendingBlock pending;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t g = it % groups, first = it / groups * kAmxRowBlock, last = std::min(rows, first + kAmxRowBlock);
      const int64_t pend = panels * (g + 1) / groups;
      for (int64_t p = panels * g / groups; p < pend; ++p) {
        const int64_t b0 = 2 * p;
        const bool two = b0 + 1 < blocks;
        const uint32_t* wp = w + b0 * bs;
        const uint32_t* next = first == 0 && p + 1 < pend ? wp + 2 * bs : nullptr;
        for (int64_t m0 = first; m0 < last; m0 += 32) {
          const bool pair = m0 + 16 < rows;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t c = 0; c < chunks; ++c) {
            if (next != nullptr && m0 == first)
              for (int64_t line = 0; line < 32; ++line)
                _mm_prefetch(reinterpret_cast<const char*>(next + (line / 16) * bs + c * 256 + (line % 16) * 16),
                             _MM_HINT_T1);
            _tile_loadd(4, rows_at(m0) + c * 16, stride(m0));
            _tile_loadd(6, wp + c * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
              _tile_loadd(7, wp + bs + c * 256, 64);
              _tile_dpbf16ps(1, 4, 7);
            }
            if (pair) {
              _tile_loadd(5, rows_at(m0 + 16) + c * 16, stride(m0 + 16));
              _tile_dpbf16ps(2, 5, 6);
              if (two) _tile_dpbf16ps(3, 5, 7);
            }
            pending.emit(per_step, block);
          }
          pending.take(m0, std::min<int64_t>(last, m0 + 32), b0, two ? 2 : 1);
        }
      }
    }
    pending.emit(32, block);
    _tile_release();
  }
}

// for_tiles on AMX tiles: each block of sums to `visit` in register tiles of MR rows.
template <class Visit>
void for_tiles_amx(const uint32_t* x, int64_t rows, int64_t xs, const uint32_t* w, int64_t units, int64_t blocks,
                   Visit&& visit) {
  auto block = [&](int64_t m0, int64_t row, int64_t row_end, int64_t b0, int nb, const float* sums) {
    V acc[MR][NR];
    for (int64_t r0 = row; r0 < row_end; r0 += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, row_end - r0));
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < 2; ++j) acc[i][j] = Vf::load(sums + (r0 - m0 + i) * 32 + j * 16);
      visit(r0, mr, b0, nb, acc);
    }
  };
  for_blocks_amx(x, rows, xs, w, units, blocks, block);
}

inline bool amx_takes(int64_t units) { return units % 16 == 0 && amx_permitted(); }
#endif

// for_tiles, on AMX tiles where they take the job.
template <class M, class Visit>
void for_tiles_any(const typename M::U* x, int64_t rows, int64_t xs, const typename M::U* w, int64_t units,
                   int64_t blocks, Visit&& visit) {
#if defined(KVRELAY_AMX)
  if constexpr (std::is_same<M, Pairs>::value) {
    if (amx_takes(units)) return for_tiles_amx(x, rows, xs, w, units, blocks, visit);
  }
#endif
  for_tiles<M>(x, rows, xs, w, units, blocks, visit);
}

inline void store_lanes(float* p, V v) { Vf::store(p, v); }
template <typename T>
inline V as_held(V v) { return v; }  // fp32: as computed
#if defined(KVRELAY_AVX512)
inline void store_lanes(at::BFloat16* p, V v) { store16(p, v); }
template <>
inline V as_held<at::BFloat16>(V v) { return round_to16<at::BFloat16>(v); }

// Per lane, the largest value seen over a row's column blocks and its column; only a strictly larger value
// replaces one seen before, so the earlier column wins a tie (and NaN never wins).
struct LaneBest {
  __m512 v = _mm512_set1_ps(-INFINITY);
  __m512i col = _mm512_set1_epi32(-1);
  void update(__m512 x, int64_t c0, int64_t valid) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask16 in = static_cast<__mmask16>(valid == L ? 0xffff : (1u << valid) - 1);
    const __mmask16 better = _mm512_mask_cmp_ps_mask(in, x, v, _CMP_GT_OQ);
    v = _mm512_mask_mov_ps(v, better, x);
    col = _mm512_mask_mov_epi32(col, better, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(c0))));
  }
  void store(float* vals, int32_t* cols) const {
    _mm512_store_ps(vals, v);
    _mm512_store_si512(cols, col);
  }
};
#else
struct LaneBest {
  __m256 v = _mm256_set1_ps(-INFINITY);
  __m256i col = _mm256_set1_epi32(-1);
  void update(__m256 x, int64_t c0, int64_t valid) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 better = _mm256_cmp_ps(x, v, _CMP_GT_OQ);
    if (valid < L) better = _mm256_and_ps(better, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lanes)));
    v = _mm256_blendv_ps(v, x, better);
    const __m256i c = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(c0)));
    col = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(col), _mm256_castsi256_ps(c), better));
  }
  void store(float* vals, int32_t* cols) const {
    _mm256_store_ps(vals, v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(cols), col);
  }
};
#endif

// Rows of the output [rows, n], 16 columns at a time: sums plus the bias, rounded once to T (as oneDNN rounds).
// The bias lanes are loaded once per column block (bias(c0)) and handed to every row's store.
template <typename T>
class OutRows {
 public:
  OutRows(T* out, int64_t n, const T* bias) : o_(out), n_(n), bias_(bias) {}
  V bias(int64_t c0) const {
    if (bias_ == nullptr) return Vf::zero();
    alignas(64) float b[L] = {};
    for (int64_t e = 0; e < std::min<int64_t>(L, n_ - c0); ++e) b[e] = load(bias_, c0 + e);
    return Vf::load(b);
  }
  void store(int64_t r, int64_t c0, V v, V b) const {
    if (bias_ != nullptr) v = Vf::add(v, b);
    const int64_t valid = std::min<int64_t>(L, n_ - c0);
    if (valid == L) {
      store_lanes(o_ + r * n_ + c0, v);
    } else {
      alignas(64) T tmp[L];
      store_lanes(tmp, v);
      std::memcpy(o_ + r * n_ + c0, tmp, valid * sizeof(T));
    }
  }
#if defined(KVRELAY_AMX)
  // 32 columns from c0 in one 64-byte store where they are all in range and there is no bias, with the
  // hardware's round-to-nearest-even (as oneDNN's bf16 outputs); otherwise as store.
  void store32(int64_t r, int64_t c0, V lo, V hi, V b_lo, V b_hi) const {
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      if (bias_ == nullptr && c0 + 2 * L <= n_) {
        _mm512_storeu_si512(o_ + r * n_ + c0, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        return;
      }
    }
    store(r, c0, lo, b_lo);
    if (c0 + L < n_) store(r, c0 + L, hi, b_hi);
  }
#endif

 private:
  T* o_;
  int64_t n_;
  const T* bias_;
};

template <class M, typename T>
void gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, const std::optional<torch::Tensor>& bias,
          torch::Tensor& out) {
  using U = typename M::U;
  const int64_t rows = x.size(0), units = packed.size(1), blocks = packed.size(0);
  const U* xp = reinterpret_cast<const U*>(x.data_ptr());
  const U* wp = reinterpret_cast<const U*>(packed.data_ptr());
  const int64_t xs = x.stride(0) * int64_t(x.element_size()) / int64_t(sizeof(U));
  const T* bp = bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
  const OutRows<T> o(reinterpret_cast<T*>(out.data_ptr()), n, bp);
#if defined(KVRELAY_AMX)
  if constexpr (std::is_same<M, Pairs>::value) {
    if (amx_takes(units)) {  // each row's 32 columns from the block of sums, in one pass over the rows
      auto block = [&](int64_t m0, int64_t row, int64_t row_end, int64_t b0, int nb, const float* sums) {
        const int64_t c0 = b0 * L;
        const V b_lo = o.bias(c0), b_hi = nb == 2 ? o.bias(c0 + L) : Vf::zero();
        for (int64_t r = row; r < row_end; ++r) {
          const float* row = sums + (r - m0) * 32;
          if (nb == 2) o.store32(r, c0, Vf::load(row), Vf::load(row + L), b_lo, b_hi);
          else o.store(r, c0, Vf::load(row), b_lo);
        }
      };
      for_blocks_amx(xp, rows, xs, wp, units, blocks, block);
      return;
    }
  }
#endif
  for_tiles<M>(xp, rows, xs, wp, units, blocks, [&](int64_t r0, int mr, int64_t b0, int nr, V (&acc)[MR][NR]) {
    for (int j = 0; j < nr; ++j) {
      const V b = o.bias((b0 + j) * L);
      for (int i = 0; i < mr; ++i) o.store(r0 + i, (b0 + j) * L, acc[i][j], b);
    }
  });
}

#if defined(KVRELAY_AMX)
// silu(x G^T) * (x U^T) for a weight packed with gate and up column blocks alternating (cpu_linear.pack_silu_mul): a panel of
// two blocks is 16 gate and the same 16 up columns, so each block of sums becomes 16 output columns, and the
// gate|up activations (twice the output) are never written.
void gemm_silu_mul(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, torch::Tensor& out) {
  const int64_t rows = x.size(0), units = packed.size(1), blocks = packed.size(0);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const int64_t xs = x.stride(0) / 2;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  auto block = [&](int64_t m0, int64_t row, int64_t row_end, int64_t b0, int, const float* sums) {
    for (int64_t r = row; r < row_end; ++r) {
      const float* s = sums + (r - m0) * 32;
      silu_mul_sums16(s, s + L, op + r * n + b0 / 2 * L);
    }
  };
  for_blocks_amx(xp, rows, xs, reinterpret_cast<const uint32_t*>(packed.data_ptr()), units, blocks, block);
}
#endif

// Per row, the first column of the largest value (NaN never wins; all-NaN rows give 0). Each thread keeps one
// LaneBest per row over all its column blocks and reduces the lanes once, at the end. Reducing them for every row
// and 32 columns (a scalar pass over the lanes) outweighed the tiles: SmolLM2's LM head at 128 rows took 8.6 ms,
// now 4.2 (AMX Xeon, 2 vCPUs).
template <class M, typename T>
void gemm_argmax(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, torch::Tensor& out) {
  using U = typename M::U;
  const int64_t rows = x.size(0), units = packed.size(1), blocks = packed.size(0);
  const U* xp = reinterpret_cast<const U*>(x.data_ptr());
  const int64_t xs = x.stride(0) * int64_t(x.element_size()) / int64_t(sizeof(U));
  const int threads = std::max(1, at::get_num_threads());
  // A thread takes a row's column blocks in increasing order, so a lane's strictly-larger rule keeps the earliest
  // column of its largest value.
  std::vector<LaneBest> lanes(threads * rows);
  for_tiles_any<M>(xp, rows, xs, reinterpret_cast<const U*>(packed.data_ptr()), units, blocks,
               [&](int64_t r0, int mr, int64_t b0, int nr, V (&acc)[MR][NR]) {
    LaneBest* mine = lanes.data() + omp_get_thread_num() * rows + r0;
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) {
        const int64_t c0 = (b0 + j) * L;
        // Logits as the dtype holds them (bf16 rounds), so the argmax is that of the logits this kernel returns.
        mine[i].update(as_held<T>(acc[i][j]), c0, std::min<int64_t>(L, n - c0));
      }
  });
  // Over the lanes of every thread: the largest value, ties to the lowest column.
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    float bv = -std::numeric_limits<float>::infinity();
    int64_t bi = -1;
    for (int t = 0; t < threads; ++t) {
      alignas(64) float vals[L];
      alignas(64) int32_t idx[L];
      lanes[t * rows + r].store(vals, idx);
      for (int e = 0; e < L; ++e)
        if (idx[e] >= 0 && (bi < 0 || vals[e] > bv || (vals[e] == bv && idx[e] < bi))) bv = vals[e], bi = idx[e];
    }
    op[r] = std::max<int64_t>(bi, 0);
  }
}

bool pairs_for(const torch::Tensor& w) {
#if defined(KVRELAY_AVX512BF16)
  return w.scalar_type() == torch::kBFloat16;
#else
  (void)w;
  return false;
#endif
}

}  // namespace

// w [N, K] fp32 (or bf16 with AVX512-BF16, K even) -> [ceil(N/L), units of K, L] float or int32 (bf16 pairs).
torch::Tensor pack_small_gemm(TensorArg weight) {
  const torch::Tensor w = weight.contiguous();
  TORCH_CHECK(w.dim() == 2, "w must be [N, K]");
  const bool pairs = pairs_for(w);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || pairs, "small_gemm: float32, or bfloat16 on AVX512-BF16");
  TORCH_CHECK(!pairs || w.size(1) % 2 == 0, "small_gemm: bf16 needs an even K");
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + L - 1) / L, units = pairs ? k / 2 : k;
  auto out = torch::zeros({blocks, units, L}, w.options().dtype(pairs ? torch::kInt32 : torch::kFloat32));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr());  // fp32, or two bf16 per unit
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  const int64_t row_units = pairs ? k / 2 : k;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t lane = 0; lane < L && b * L + lane < n; ++lane)
        for (int64_t u = 0; u < units; ++u) dst[(b * units + u) * L + lane] = src[(b * L + lane) * row_units + u];
  });
  return out;
}

// x [M, K] (rows contiguous) in the weight's dtype -> [M, n]; bias [n] or None.
torch::Tensor small_gemm(TensorArg x, TensorArg packed, int64_t n, OptTensorArg bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const bool pairs = packed.scalar_type() == torch::kInt32;
  TORCH_CHECK(x.size(1) == packed.size(1) * (pairs ? 2 : 1), "x's K does not match the packed weight");
  TORCH_CHECK(x.scalar_type() == (pairs ? torch::kBFloat16 : torch::kFloat32), "x's dtype does not match the weight");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == x.scalar_type()),
              "bias must be [n] in x's dtype");
  auto out = torch::empty({x.size(0), n}, x.options());
#if defined(KVRELAY_AVX512BF16)
  if (pairs) {
    gemm<Pairs, at::BFloat16>(x, packed, n, bias, out);
    return out;
  }
#endif
  gemm<F32, float>(x, packed, n, bias, out);
  return out;
}

// argmax over columns of small_gemm(x, packed, n) per row, int64 [M]; ties go to the lowest column.
torch::Tensor small_gemm_argmax(TensorArg x, TensorArg packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const bool pairs = packed.scalar_type() == torch::kInt32;
  TORCH_CHECK(x.size(1) == packed.size(1) * (pairs ? 2 : 1), "x's K does not match the packed weight");
  TORCH_CHECK(x.scalar_type() == (pairs ? torch::kBFloat16 : torch::kFloat32), "x's dtype does not match the weight");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
#if defined(KVRELAY_AVX512BF16)
  if (pairs) {
    gemm_argmax<Pairs, at::BFloat16>(x, packed, n, out);
    return out;
  }
#endif
  gemm_argmax<F32, float>(x, packed, n, out);
  return out;
}

// x [M, K] bf16 -> silu(gate) * up [M, n], where packed = pack_small_gemm of the gate|up weight [2n, K] with
// its 16-row blocks of gate and of up alternating (n a multiple of 16, K of 32); AMX only.
torch::Tensor small_gemm_silu_mul(TensorArg x, TensorArg packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kBFloat16,
              "x must be [M, K] bf16 with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == torch::kInt32 && x.size(1) == packed.size(1) * 2,
              "x's K does not match the packed weight");
  TORCH_CHECK(n % L == 0 && packed.size(0) == 2 * n / L, "packed must hold 2n outputs, n a multiple of 16");
  auto out = torch::empty({x.size(0), n}, x.options());
#if defined(KVRELAY_AMX)
  TORCH_CHECK(amx_takes(packed.size(1)), "small_gemm_silu_mul runs on AMX tiles, with K a multiple of 32");
  gemm_silu_mul(x, packed, n, out);
#else
  TORCH_CHECK(false, "small_gemm_silu_mul needs AMX");
#endif
  return out;
}

bool small_gemm_available() { return true; }

bool amx_tiles() {
#if defined(KVRELAY_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

#else  // vector kernels only

torch::Tensor pack_small_gemm(TensorArg) { TORCH_CHECK(false, "small_gemm needs AVX2 + FMA or AVX512"); }
torch::Tensor small_gemm(TensorArg, TensorArg, int64_t, OptTensorArg) {
  TORCH_CHECK(false, "small_gemm needs AVX2 + FMA or AVX512");
}
torch::Tensor small_gemm_silu_mul(TensorArg, TensorArg, int64_t) { TORCH_CHECK(false, "small_gemm_silu_mul needs AMX"); }
torch::Tensor small_gemm_argmax(TensorArg, TensorArg, int64_t) {
  TORCH_CHECK(false, "small_gemm needs AVX2 + FMA or AVX512");
}
bool small_gemm_available() { return false; }
bool amx_tiles() { return false; }

#endif

}  // namespace kvrelay
