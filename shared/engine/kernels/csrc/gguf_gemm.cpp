// y = x W^T + b with W in a GGUF block format as the file stores it (Q4_0, Q4_1, Q8_0: blocks of 32 weights
// along K, each with an fp16 scale, and for Q4_1 an fp16 minimum; the K-quants Q4_K, Q5_K, Q6_K: super-blocks of
// 256, gguf_kquants.h), never dequantized as a whole.
//
// As llama.cpp does, each row of x is first quantized per block of 32 to int8 with a scale (dx = max|x| / 127,
// rounded to nearest), and a block's dot product is an integer one: sum_i q_i * xq_i in int32, then
//   Q4_0  w = d (q - 8)  ->  d dx sum(q xq) - 8 d dx sum(xq)
//   Q4_1  w = d q + m    ->  d dx sum(q xq) + m dx sum(xq)
//   Q8_0  w = d q        ->  d dx sum(q xq)
// Each thread takes a range of W's rows; every row's blocks are unpacked once for up to 4 rows of x (the row
// tiles). A row's result depends on its own x row only (no reduction across rows). From kLaneRows (8) rows, with
// AVX512-VNNI, Q4_0, Q4_1 and Q8_0 run on the wide kernel (gguf_wide.h: W's rows in the lanes, 1.2-1.6x faster
// than what ran before from 8 to 2,048 rows, docs/quantization.md), and the K-quants on the lanes kernel from 12
// (gguf_lanes.h: x's rows in the lanes); below, on the row tiles, whose float sums are rounded otherwise: a decode
// gets the same logits alone or batched below that count, and a row the same from it on. A block's integer sum
// is one vpdpbusd where the CPU has AVX512-VNNI, else maddubs + madd (the same exact int32s). Each type has its
// own row tile (no branch on the type per block), and bf16 x is read and y written in bf16 here (no conversion op
// on each side of each projection in a bf16 model; what these bought a single-stream decode is in
// docs/benchmarks.md). gguf_dequantize turns blocks back into fp32 rows
// (an embedding's looked-up rows, a prefill's tile).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "api.h"
#include "common.h"
#include "gguf_kquants.h"
#include "gguf_lanes.h"
#include "gguf_wide.h"
#include "gguf_xquant.h"
#include "vec.h"

namespace {

constexpr int kBlock = 32;
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // ggml's type numbers

int64_t block_bytes(int64_t t) {
  switch (t) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
  }
  if (kquants::is_kquant(t)) return kquants::super_bytes(t);
  TORCH_CHECK(false, "gguf: unsupported block type ", t,
              " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  return 0;
}

// Weights per block: 32, or a K-quant's super-block of 256.
int64_t block_elems(int64_t t) { return kquants::is_kquant(t) ? kquants::kSuper : kBlock; }

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef KVRELAY_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
      bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// sum_i q_i * xq_i over one block, q the weight's 32 values.
#ifdef KVRELAY_AVX2
inline __m256i unpack_q4(const uint8_t* qs) {  // byte j: q[j] in the low nibble, q[j + 16] in the high one
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}
// The exact int32 sums of 4 byte products per lane: one vpdpbusd with AVX512-VNNI (VL), else maddubs + madd
// (no pair of products reaches int16's limit: |q| <= 128, |x| <= 127).
inline __m256i sum_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline __m256 dot_u8_i8(__m256i q, const int8_t* xq) {  // q unsigned (0..15)
  return _mm256_cvtepi32_ps(sum_u8_i8(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))));
}
inline __m256 dot_i8_i8(__m256i q, const int8_t* xq) {  // both signed: |q| times x with q's sign
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  return _mm256_cvtepi32_ps(sum_u8_i8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)));
}
#endif

inline int dot_scalar(const uint8_t* block, int64_t t, const int8_t* xq) {
  int s = 0;
  if (t == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < kBlock; ++i) s += q[i] * xq[i];
    return s;
  }
  const uint8_t* qs = block + (t == kQ4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) s += (qs[j] & 0x0f) * xq[j] + (qs[j] >> 4) * xq[j + 16];
  return s;
}

// Rows [m0, m0 + MT) of x against weight row n, of type T (a template parameter: no branch on it per block).
template <int64_t T, int MT>
void row_tile(const uint8_t* wrow, int64_t B, int64_t bsz, const int8_t* xq, const float* dx, const float* sx,
              int64_t K, float* out) {
  constexpr int64_t t = T;
  float extra[MT] = {};
#ifdef KVRELAY_AVX2
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
#else
  float acc[MT] = {};
#endif
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk = wrow + b * bsz;
    const float d = half_to_float(blk);
#ifdef KVRELAY_AVX2
    const __m256i q = t == kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))
                                 : unpack_q4(blk + (t == kQ4_1 ? 4 : 2));
#endif
    const float lo = t == kQ4_1 ? half_to_float(blk + 2) : (t == kQ4_0 ? -8.f * d : 0.f);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = m * (K / kBlock) + b;
#ifdef KVRELAY_AVX2
      const __m256 p = t == kQ8_0 ? dot_i8_i8(q, xq + i * kBlock) : dot_u8_i8(q, xq + i * kBlock);
      acc[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dx[i]), acc[m]);
#else
      acc[m] += static_cast<float>(dot_scalar(blk, t, xq + i * kBlock)) * (d * dx[i]);
#endif
      extra[m] += lo * sx[i];
    }
  }
  for (int m = 0; m < MT; ++m) {
#ifdef KVRELAY_AVX2
    out[m] = kvrelay::hsum8(acc[m]) + extra[m];
#else
    out[m] = acc[m] + extra[m];
#endif
  }
}

// The K-quants' rows [m0, m0 + MT) against weight row n: a sub-block of 32 per block of x (gguf_kquants.h).
#ifdef KVRELAY_AVX2
inline __m256i kq_sub(const uint8_t* sb, int64_t t, int j) {  // sub-block j's 32 q (Q6_K: minus 32, signed)
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  if (t == kquants::kQ6_K) {
    const int h = j / 4, jj = j % 4;
    const __m256i lo = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + h * 64 + (jj % 2) * 32)),
                          4 * (jj / 2)), low4);
    const __m256i hi = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + h * 32)), 2 * jj),
        _mm256_set1_epi8(0x03));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
  const uint8_t* qs = sb + (t == kquants::kQ4_K ? 16 : 48);
  __m256i q = _mm256_and_si256(
      _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (j / 2) * 32)), 4 * (j % 2)), low4);
  if (t == kquants::kQ5_K) {
    const __m256i bits = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16)), j), _mm256_set1_epi8(1));
    q = _mm256_or_si256(q, _mm256_slli_epi16(bits, 4));
  }
  return q;
}
#endif

template <int64_t T, int MT>
void kq_row_tile(const uint8_t* wrow, int64_t B, int64_t bsz, const int8_t* xq, const float* dx, const float* sx,
                 int64_t K, float* out) {
  (void)K;
  constexpr int64_t t = T;  // a template parameter, as in row_tile
  constexpr bool q6 = T == kquants::kQ6_K;
#ifdef KVRELAY_AVX2
  // Per super-block, all 8 sub-blocks' factors at once: d sc_j (and -dmin m_j) as vectors, times the 8 activation
  // scales of each row of x; the minimums' part of every sub-block in one FMA per row.
  __m256 acc[MT], extra[MT];
  for (int m = 0; m < MT; ++m) acc[m] = extra[m] = _mm256_setzero_ps();
  alignas(32) float scale[MT][8];
  for (int64_t s = 0; s < B / 8; ++s) {
    const uint8_t* sb = wrow + s * bsz;
    __m256 dl, lo = _mm256_setzero_ps();
    if (q6) {
      dl = _mm256_set1_ps(half_to_float(sb + 208));
    } else {
      alignas(16) uint8_t sm[16];
      kquants::scales_and_mins(sb + 4, sm);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm))));
      const __m256 mn =
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8))));
      dl = _mm256_mul_ps(_mm256_set1_ps(half_to_float(sb)), sc);
      lo = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(half_to_float(sb + 2)), mn));
    }
    for (int m = 0; m < MT; ++m) {
      const int64_t i0 = m * B + s * 8;
      _mm256_store_ps(scale[m], _mm256_mul_ps(dl, _mm256_loadu_ps(dx + i0)));
      if (!q6) extra[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(sx + i0), extra[m]);
    }
    for (int j = 0; j < 8; ++j) {
      const __m256i q = kq_sub(sb, t, j);
      const __m256i scales = q6 ? _mm256_set_m128i(_mm_set1_epi16(static_cast<int8_t>(sb[192 + 2 * j + 1])),
                                                   _mm_set1_epi16(static_cast<int8_t>(sb[192 + 2 * j])))
                                : _mm256_setzero_si256();
      for (int m = 0; m < MT; ++m) {
        const int8_t* xb = xq + (m * B + s * 8 + j) * kBlock;
        __m256 p;
        if (q6) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
          p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scales));
        } else {
          p = dot_u8_i8(q, xb);
        }
        acc[m] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&scale[m][j]), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = kvrelay::hsum8(acc[m]) + kvrelay::hsum8(extra[m]);
#else
  float acc[MT] = {}, extra[MT] = {};
  for (int64_t s = 0; s < B / 8; ++s) {
    const uint8_t* sb = wrow + s * bsz;
    const float d = half_to_float(q6 ? sb + 208 : sb), dmin = q6 ? 0.f : half_to_float(sb + 2);
    uint8_t sm[16];
    if (!q6) kquants::scales_and_mins(sb + 4, sm);
    for (int j = 0; j < 8; ++j) {
      float dl = d, lo = 0.f;
      int sc_a = 1, sc_b = 1;
      if (q6) {
        sc_a = static_cast<int8_t>(sb[192 + 2 * j]);
        sc_b = static_cast<int8_t>(sb[192 + 2 * j + 1]);
      } else {
        dl = d * static_cast<float>(sm[j]);
        lo = -(dmin * static_cast<float>(sm[8 + j]));
      }
      for (int m = 0; m < MT; ++m) {
        const int64_t i = m * B + s * 8 + j;
        const int8_t* xb = xq + i * kBlock;
        int dot = 0;
        for (int l = 0; l < 32; ++l) dot += kquants::q_at(sb, t, j, l) * xb[l] * (l < 16 ? sc_a : sc_b);
        acc[m] += static_cast<float>(dot) * (dl * dx[i]);
        extra[m] += lo * sx[i];
      }
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = acc[m] + extra[m];
#endif
}

// Rows [m0, m0 + MT) of x against weight row n, of type T: the K-quants' tile or the 32-value blocks' one.
template <int64_t T, int MT>
void tile(const uint8_t* wrow, int64_t B, int64_t bsz, const int8_t* xq, const float* dx, const float* sx, int64_t K,
          float* out) {
  if constexpr (kquants::is_kquant(T)) {
    kq_row_tile<T, MT>(wrow, B, bsz, xq, dx, sx, K, out);
  } else {
    row_tile<T, MT>(wrow, B, bsz, xq, dx, sx, K, out);
  }
}
using RowTileFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t,
                           float*);
constexpr int kTileRows = 4;

// A decode's one row of x against weight rows [n0, n1), into y[n0, n1): the tile called directly, not through the
// table once per weight row (that call and its loop were ~8% of a single-stream decode step).
template <RowTileFn Tile>
void one_row_span(const uint8_t* wp, int64_t row_bytes, int64_t n0, int64_t n1, int64_t B, int64_t bsz,
                  const int8_t* xq, const float* dx, const float* sx, int64_t K, float* y) {
  for (int64_t n = n0; n < n1; ++n) Tile(wp + n * row_bytes, B, bsz, xq, dx, sx, K, y + n);
}
using SpanFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const int8_t*, const float*,
                        const float*, int64_t, float*);

// Everything gguf_gemm runs for one type, picked once: the tiles of 1 to 4 rows of x, and the one-row span.
struct TypeKernels {
  const RowTileFn* tiles;
  SpanFn span;
};
template <int64_t T>
constexpr RowTileFn kTiles[kTileRows] = {tile<T, 1>, tile<T, 2>, tile<T, 3>, tile<T, 4>};
template <int64_t T>
constexpr TypeKernels kKernels = {kTiles<T>, one_row_span<tile<T, 1>>};

TypeKernels kernels_for(int64_t qtype) {
  switch (qtype) {
    case kquants::kQ4_K: return kKernels<kquants::kQ4_K>;
    case kquants::kQ5_K: return kKernels<kquants::kQ5_K>;
    case kquants::kQ6_K: return kKernels<kquants::kQ6_K>;
    case kQ4_0: return kKernels<kQ4_0>;
    case kQ4_1: return kKernels<kQ4_1>;
    default: return kKernels<kQ8_0>;  // check_weight has refused any other type
  }
}

#ifdef KVRELAY_GGUF_LANES
// Sub-block b of a K-quant weight row for the lanes kernel (gguf_lanes.h): its 32 values as int8 in order into q, and
// gguf_lanes::Sub. One functor type per block type, so that the kernel's call is inlined (through a function
// pointer, every call spilled the tile's sums).
inline int32_t half_sum(__m128i sad) {  // of _mm_sad_epu8's two 64-bit sums
  return static_cast<int32_t>(_mm_cvtsi128_si64(sad) + _mm_extract_epi64(sad, 1));
}
// The sums of 32 bytes' two halves of 16, unsigned or (kSigned) signed.
template <bool kSigned>
inline std::pair<int32_t, int32_t> half_sums(__m256i v) {
  const int32_t bias = kSigned ? 16 * 128 : 0;  // a signed byte + 128 is its unsigned one
  const __m256i s = _mm256_sad_epu8(kSigned ? _mm256_xor_si256(v, _mm256_set1_epi8(-128)) : v, _mm256_setzero_si256());
  return {half_sum(_mm256_castsi256_si128(s)) - bias, half_sum(_mm256_extracti128_si256(s, 1)) - bias};
}
template <bool kSigned>
inline int32_t byte_sum(__m256i v) {
  const auto [a, b] = half_sums<kSigned>(v);
  return a + b;
}


template <int64_t T>
struct LaneKQuants {  // sub-block b % 8 of super-block b / 8
  static constexpr bool kHalves = T == kquants::kQ6_K;
  void operator()(const uint8_t* wrow, int64_t b, int64_t bsz, uint8_t* q, kvrelay::gguf_lanes::Sub& s) const {
    const uint8_t* sb = wrow + (b / 8) * bsz;
    const int j = static_cast<int>(b % 8);
    const __m256i v = kq_sub(sb, T, j);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), v);
    if constexpr (T == kquants::kQ6_K) {  // w = d sc (q - 32), sc per half; q here already less 32
      std::tie(s.qs, s.qs_hi) = half_sums<true>(v);
      s.d = half_to_float(sb + 208);
      s.lo = 0.f;
      s.sc = static_cast<int8_t>(sb[192 + 2 * j]);
      s.sc_hi = static_cast<int8_t>(sb[192 + 2 * j + 1]);
    } else {  // w = (d sc_j) q - dmin m_j
      uint8_t sc, m;  // this sub-block's only: the kernel asks for each of a super-block's 8 apart
      kquants::scale_min(sb + 4, j, sc, m);
      s.d = half_to_float(sb) * static_cast<float>(sc);
      s.lo = -(half_to_float(sb + 2) * static_cast<float>(m));
      s.qs = byte_sum<false>(v);
    }
  }
};

// From this many rows of x, the wide kernel (Q4_0, Q4_1, Q8_0) and the lanes kernel (the K-quants); below, the
// row tiles. The wide kernel reads a tile's 16 weight rows side by side, which the prefetchers follow badly when a
// model's weights stream from memory: at 1 row it took twice the row tile's time (docs/quantization.md). On the
// lanes kernel, 30 SmolLM2-shaped layers of Q4_1 (bf16 x, 2 threads, Zen 4) took 13.2 against the row tiles' 12.7
// ms at 8 rows, 16.5 against 25.4 at 16, 22.1 against 48.5 at 32, 80.6 against 197 at 128. The K-quants unpack
// each sub-block's scales too: 16 Q4_K_M-shaped layers (1024 wide, Q4_K and Q6_K) took 28.5 against 22.3 ms at 8
// rows, 29.0 against 32.1 at 12, 38.0 against 84.6 at 32, 69.8 against 168 at 64.
constexpr int64_t kLaneRows = 8, kKQuantLaneRows = 12;
#endif

template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {  // v's memory, grown to n if shorter; never shrunk
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

void check_weight(const at::Tensor& w, int64_t t, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf: the weight must be contiguous uint8 [N, row bytes]");
  const int64_t elems = block_elems(t);
  TORCH_CHECK(K % elems == 0, "gguf: K must be a multiple of ", elems, " for type ", t, ", got ", K);
  TORCH_CHECK(w.size(1) == K / elems * block_bytes(t), "gguf: a row of ", K, " weights of type ", t, " is ",
              K / elems * block_bytes(t), " bytes, not ", w.size(1));
}

}  // namespace

namespace kvrelay {

at::Tensor gguf_gemm(TensorArg x_in, TensorArg w, int64_t qtype, OptTensorArg bias) {
  TORCH_CHECK(x_in.dim() == 2, "gguf_gemm: x must be [M, K]");
  // bf16 x is read and y written in bf16 here (rounded as torch rounds), so the model's dtype costs no extra ops.
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  const at::Tensor x = bf16 ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  const int64_t B = K / kBlock, bsz = block_bytes(qtype), row_bytes = w.size(1);
  // x's int8 rows and scales, in buffers this thread keeps from call to call: fresh ones were zeroed (3 MB a
  // projection in a 2,048-token chunk: 1.8% of a served run), or, not zeroed, first touched page by page.
  thread_local std::vector<int8_t> xq_kept;
  thread_local std::vector<float> dx_kept, sx_kept;
  int8_t* const xq = at_least(xq_kept, M * K);
  float* const dx = at_least(dx_kept, M * B);
  float* const sx = at_least(sx_kept, M * B);
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t e) {
    std::vector<float> buf;
    for (int64_t m = a; m < e; ++m) {
      if (bf16) gguf_x::quantize(x.data_ptr<at::BFloat16>() + m * K, K, xq + m * K, dx + m * B, sx + m * B, buf);
      else gguf_x::quantize(x.data_ptr<float>() + m * K, K, xq + m * K, dx + m * B, sx + m * B, buf);
    }
  });
  at::Tensor y = at::empty({M, N}, x.options());
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  uint16_t* yh = bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gguf_gemm: bias must have N values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const TypeKernels kernels = kernels_for(qtype);
  auto store = [&](int64_t at, int64_t n, float v) {  // y[at] (row-major [M, N]) = v + bias[n], in y's dtype
    v = bp ? v + bp[n] : v;
    if (yh) yh[at] = f32_to_bf16(v); else yf[at] = v;
  };
#ifdef KVRELAY_GGUF_WIDE
  // From kLaneRows rows: below, the row tiles stream a model's weights from memory faster (see kLaneRows)
  if (M >= kLaneRows && (qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0)) {
    // 16 results of row m at columns [n, n + cols): + bias, in y's dtype (bf16 rounded as torch rounds).
    at::BFloat16* const ybf = bf16 ? y.data_ptr<at::BFloat16>() : nullptr;
    auto put = [&](int64_t m, int64_t n, int cols, __m512 v) {
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
      if (bp) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + n));
      if (ybf) store16(ybf + m * N + n, v, mask);
      else store16(yf + m * N + n, v, mask);
    };
    // Threads take whole tiles of 16 output rows.
    at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
      const int64_t n0 = 16 * t0, n1 = std::min(N, 16 * t1);
      auto run = [&](auto type) {
        gguf_wide::gemm<decltype(type)::value>(wp, row_bytes, N, n0, n1, B, xq, dx, sx, M, put);
      };
      switch (qtype) {
        case kQ4_0: run(std::integral_constant<int64_t, kQ4_0>{}); break;
        case kQ4_1: run(std::integral_constant<int64_t, kQ4_1>{}); break;
        default: run(std::integral_constant<int64_t, kQ8_0>{}); break;
      }
    });
    return y;
  }
#endif
#ifdef KVRELAY_GGUF_LANES
  if (M >= kKQuantLaneRows) {  // the K-quants (the others ran on the wide kernel above)
    gguf_lanes::Packed packed;
    packed.pack(xq, dx, sx, M, K);
    auto put = [&](int64_t m, int64_t n, float v) { store(m * N + n, n, v); };
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      auto walk = [&](auto unpack) { gguf_lanes::rows(wp, row_bytes, n0, n1, B, bsz, packed, M, unpack, put); };
      switch (qtype) {
        case kquants::kQ4_K: walk(LaneKQuants<kquants::kQ4_K>{}); break;
        case kquants::kQ5_K: walk(LaneKQuants<kquants::kQ5_K>{}); break;
        default: walk(LaneKQuants<kquants::kQ6_K>{}); break;  // check_weight has refused any other type
      }
    });
    return y;
  }
#endif
  if (M == 1) {
    std::vector<float> acc(N);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      kernels.span(wp, row_bytes, n0, n1, B, bsz, xq, dx, sx, K, acc.data());
      for (int64_t n = n0; n < n1; ++n) store(n, n, acc[n]);
    });
    return y;
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float out[kTileRows];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = wp + n * row_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t mt = std::min<int64_t>(kTileRows, M - m0);
        kernels.tiles[mt - 1](wrow, B, bsz, xq + m0 * K, dx + m0 * B, sx + m0 * B, K, out);
        for (int64_t m = 0; m < mt; ++m) store((m0 + m) * N + n, n, out[m]);
      }
    }
  });
  return y;
}

bool gguf_any_rows(int64_t qtype) {
#ifdef KVRELAY_GGUF_WIDE
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0;
#else
  (void)qtype;
  return false;
#endif
}

at::Tensor gguf_dequantize(TensorArg w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int64_t R = w.size(0), B = K / kBlock, bsz = block_bytes(qtype), row_bytes = w.size(1);
  at::Tensor out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (kquants::is_kquant(qtype)) {
        for (int64_t s = 0; s < K / kquants::kSuper; ++s) {
          const uint8_t* sb = wp + r * row_bytes + s * bsz;
          float* o = op + r * K + s * kquants::kSuper;
          if (qtype == kquants::kQ6_K) {
            const float d = half_to_float(sb + 208);
            for (int e = 0; e < kquants::kSuper; ++e)
              o[e] = (d * static_cast<float>(static_cast<int8_t>(sb[192 + e / 16]))) *
                     static_cast<float>(kquants::q_at(sb, qtype, e / 32, e % 32));
            continue;
          }
          const float d = half_to_float(sb), dmin = half_to_float(sb + 2);
          uint8_t sm[16];
          kquants::scales_and_mins(sb + 4, sm);
          for (int j = 0; j < 8; ++j) {
            const float dl = d * static_cast<float>(sm[j]), ml = dmin * static_cast<float>(sm[8 + j]);
            for (int l = 0; l < 32; ++l) o[j * 32 + l] = dl * static_cast<float>(kquants::q_at(sb, qtype, j, l)) - ml;
          }
        }
        continue;
      }
      for (int64_t b = 0; b < B; ++b) {
        const uint8_t* blk = wp + r * row_bytes + b * bsz;
        float* o = op + r * K + b * kBlock;
        const float d = half_to_float(blk);
        if (qtype == kQ8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int i = 0; i < kBlock; ++i) o[i] = d * q[i];
          continue;
        }
        const float lo = qtype == kQ4_1 ? half_to_float(blk + 2) : -8.f * d;
        const uint8_t* qs = blk + (qtype == kQ4_1 ? 4 : 2);
        for (int j = 0; j < 16; ++j) {
          o[j] = d * (qs[j] & 0x0f) + lo;
          o[j + 16] = d * (qs[j] >> 4) + lo;
        }
      }
    }
  });
  return out;
}

}  // namespace kvrelay
