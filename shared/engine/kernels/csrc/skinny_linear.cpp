// y = x W^T + b for a few rows of x (decodes, speculative verification): W is streamed from memory once per
// tile of up to 8 rows, which keeps small-row matmuls as cheap as a matrix-vector product (a general GEMM
// pays far more for 2..16 rows on CPU). Each output element is one accumulator over k in blocks of 8, summed
// in a fixed order, whatever the number of rows: a row's result never depends on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVRELAY_AVX2 1
#endif

namespace {

#ifdef KVRELAY_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Rows [0, M) of x against weight rows [n0, n1), R weight rows at a time (more independent accumulators for
// fewer x rows; the accumulation of one output element is the same for every M and R).
template <int M, int R>
void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
  int64_t n = n0;
  for (; n < n1; n += R) {
    const int64_t r_here = n + R <= n1 ? R : n1 - n;
    float out[M][R];
#ifdef KVRELAY_AVX2
    __m256 acc[M][R];
    const float* wr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wr[r] = w + (n + (r < r_here ? r : 0)) * K;  // past the end: repeat a row
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(wr[r] + k);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) out[m][r] = hsum(acc[m][r]);
#else
    int64_t k = 0;
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) out[m][r] = 0.f;
#endif
    for (int r = 0; r < r_here; ++r) {
      const float* wr = w + (n + r) * K;
      for (int m = 0; m < M; ++m) {
        float s = out[m][r];
        for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * wr[kk];
        y[m * N + n + r] = bias ? s + bias[n + r] : s;
      }
    }
  }
}

template <int M>
void rows(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N) {
  constexpr int R = M == 1 ? 4 : 1;  // M * R + R + 1 vector registers at most 16
  const int64_t blocks = (N + R - 1) / R;
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    tile<M, R>(x, w, bias, y, K, N, b0 * R, std::min(N, b1 * R));
  });
}

using RowsFn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t);
constexpr RowsFn kRows[8] = {rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

}  // namespace

namespace kvrelay {

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "skinny_linear: w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bad bias");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Tiles of 8 rows: W is read once per tile; a tile's rows are contiguous in y.
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t mt = std::min<int64_t>(8, M - m0);
    kRows[mt - 1](xp + m0 * K, w.data_ptr<float>(), b, yp + m0 * N, K, N);
  }
  return y;
}

}  // namespace kvrelay
