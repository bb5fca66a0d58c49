// y = x W^T + b for a few rows of x (decodes, speculative verification). Each thread takes a range of W's
// rows and walks it in chunks that fit in L2; every tile of up to 8 rows of x runs over a chunk before the
// next one, so W is streamed from memory once whatever the number of rows (a general GEMM pays far more for
// 2..32 rows on CPU). Each output element is one accumulator over k in blocks of 8, summed in a fixed order,
// whatever the number of rows: a row's result never depends on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "api.h"
#include "common.h"

namespace {

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
      for (int r = 0; r < R; ++r) out[m][r] = kvrelay::hsum8(acc[m][r]);
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

using TileFn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
// Tiles of up to 8 rows of x against R rows of W: M * R accumulators + R weight vectors + 1 x vector fit in
// the 16 AVX2 registers (measured: 8 x 1 beat 4 x 3 for 4..32 rows).
constexpr int kTileRows = 8;
constexpr TileFn kTiles[kTileRows] = {tile<1, 4>, tile<2, 1>, tile<3, 1>, tile<4, 1>,
                                      tile<5, 1>, tile<6, 1>, tile<7, 1>, tile<8, 1>};

// W rows per chunk: ~128 KiB of W stays in L2 while every row tile passes over it.
int64_t chunk_rows(int64_t K) { return std::max<int64_t>(8, (int64_t{128} << 10) / (K * 4) / 4 * 4); }

void all_rows(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t chunk = chunk_rows(K);
  at::parallel_for(0, N, std::max<int64_t>(64, chunk), [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
      const int64_t c1 = std::min(n1, c0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t mt = std::min<int64_t>(kTileRows, M - m0);
        kTiles[mt - 1](x + m0 * K, w, bias, y + m0 * N, K, N, c0, c1);
      }
    }
  });
}

}  // namespace

namespace kvrelay {

torch::Tensor skinny_linear(TensorArg x_in, TensorArg w, OptTensorArg bias) {
  const torch::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: float32 only");
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
  all_rows(xp, w.data_ptr<float>(), b, yp, M, K, N);
  return y;
}

}  // namespace kvrelay
