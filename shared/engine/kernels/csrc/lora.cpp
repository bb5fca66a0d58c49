// The LoRA update of a batch whose rows use different adapters, in one call (the BGMV/SGMV idea of Punica and
// S-LoRA): y[t] += B[s_t] (A[s_t] x[t]) for every row t whose adapter slot s_t is >= 0; rows of the base model
// (slot -1) are left alone.
//
// The rows are grouped by slot first, so each adapter's weights are read from memory once per call whatever the
// number of its rows, and the two halves run as one parallel loop each:
// - shrink: buf[t, j] = A[s, j] . x[t], the work split by (slot, rank row j): a thread streams its own rows of A
//   and dots each with the group's rows of x, four rows at a time;
// - expand: y[t, cols] += sum_j buf[t, j] Bt[s, j, cols], the work split by column chunks: a thread owns its
//   columns of y for every row, and each adapter's Bt chunk stays in L1 while its rows go by.
// A fused projection (q|k|v, gate|up) stacks its shards' A matrices (S x R rows of A: one pass over x) and keeps
// B transposed side by side, shard s's columns taking rank rows [s R, (s + 1) R) of buf.
// A row's sums run in the same order whatever the rows beside it: its output never depends on the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "api.h"
#include "common.h"
#include "vec.h"

namespace {

using kvrelay::load;
using kvrelay::put;

#if defined(KVRELAY_AVX2)
using V = kvrelay::Vf;
constexpr int kW = V::W;
inline void store_w(float* p, V::R v) { V::store(p, v); }
#if defined(KVRELAY_AVX512)
inline void store_w(at::BFloat16* p, V::R v) { kvrelay::store16(p, v); }
#else
inline void store_w(at::BFloat16* p, V::R v) { kvrelay::store8(p, v); }
#endif
#endif

struct Groups {
  std::vector<int64_t> slots;  // the active slots, ascending
  std::vector<int64_t> start;  // rows of slots[i]: order[start[i] .. start[i + 1])
  std::vector<int64_t> order;  // row indexes grouped by slot
};

Groups group_rows(const int32_t* slot_of, int64_t rows, int64_t num_slots) {
  std::vector<int64_t> count(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = slot_of[t];
    TORCH_CHECK(s < num_slots, "lora_add: slot ", s, " past the ", num_slots, " slots");
    if (s >= 0) ++count[s + 1];
  }
  Groups g;
  std::vector<int64_t> at(num_slots, 0);
  int64_t total = 0;
  for (int64_t s = 0; s < num_slots; ++s) {
    if (count[s + 1] == 0) continue;
    g.slots.push_back(s);
    g.start.push_back(total);
    at[s] = total;
    total += count[s + 1];
  }
  g.start.push_back(total);
  g.order.resize(total);
  for (int64_t t = 0; t < rows; ++t)
    if (slot_of[t] >= 0) g.order[at[slot_of[t]]++] = t;
  return g;
}

// buf[t, j] = a_row . x[t] for the group's rows, up to 4 at a time (each row's sum in the same order).
template <typename T>
void shrink_rows(const T* a_row, const T* x, int64_t K, const int64_t* rows, int64_t n, float* buf, int64_t ld,
                 int64_t j) {
  for (int64_t g = 0; g < n; g += 4) {
    const int64_t m = std::min<int64_t>(4, n - g);
    const T* xr[4];
    for (int i = 0; i < 4; ++i) xr[i] = x + rows[g + (i < m ? i : 0)] * K;
    float sums[4] = {0.f, 0.f, 0.f, 0.f};
    int64_t k = 0;
#if defined(KVRELAY_AVX2)
    V::R acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
    for (; k + kW <= K; k += kW) {
      const V::R av = kvrelay::load_w(a_row + k);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[i] = V::fma(av, kvrelay::load_w(xr[i] + k), acc[i]);
    }
    for (int i = 0; i < 4; ++i) sums[i] = V::hsum(acc[i]);
#endif
    for (; k < K; ++k) {
      const float av = load(a_row, k);
      for (int i = 0; i < 4; ++i) sums[i] += av * load(xr[i], k);
    }
    for (int64_t i = 0; i < m; ++i) buf[rows[g + i] * ld + j] = sums[i];
  }
}

// y[t, c0:c1] += sum_j buf[t, j0 + j] bt[j, c0:c1] for the group's rows.
template <typename T>
void expand_rows(const T* bt, int64_t N, int64_t R, const float* buf, int64_t ld, int64_t j0, const int64_t* rows,
                 int64_t n, T* y, int64_t ldy, int64_t c0, int64_t c1) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = rows[i];
    const float* w = buf + t * ld + j0;
    T* yr = y + t * ldy;
    int64_t c = c0;
#if defined(KVRELAY_AVX2)
    for (; c + kW <= c1; c += kW) {
      V::R acc = V::zero();
      for (int64_t j = 0; j < R; ++j) acc = V::fma(V::set1(w[j]), kvrelay::load_w(bt + j * N + c), acc);
      store_w(yr + c, V::add(kvrelay::load_w(yr + c), acc));
    }
#endif
    for (; c < c1; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < R; ++j) acc += w[j] * load(bt, j * N + c);
      put(yr, c, load(yr, c) + acc);
    }
  }
}

template <typename T>
void lora_add_impl(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                   const int32_t* slot_of, const std::vector<int64_t>& shard_cols) {
  const int64_t rows = x.size(0), K = x.size(1), L = a.size(0), SR = a.size(1), R = bt.size(1), N = bt.size(2);
  const int64_t ldy = y.stride(0);
  const Groups groups = group_rows(slot_of, rows, L);
  const int64_t active = static_cast<int64_t>(groups.slots.size());
  if (active == 0) return;
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  std::vector<float> buf(rows * SR, 0.f);
  float* bufp = buf.data();
  at::parallel_for(0, active * SR, 8, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t g = item / SR, j = item % SR, s = groups.slots[g];
      const int64_t first = groups.start[g], n = groups.start[g + 1] - first;
      shrink_rows(ap + (s * SR + j) * K, xp, K, groups.order.data() + first, n, bufp, SR, j);
    }
  });
  // Column chunks of every shard: (shard, first column, past the last).
  constexpr int64_t kChunk = 64;
  std::vector<int64_t> chunk_shard, chunk_c0, chunk_c1;
  for (size_t s = 0; s + 1 < shard_cols.size(); ++s)
    for (int64_t c = shard_cols[s]; c < shard_cols[s + 1]; c += kChunk) {
      chunk_shard.push_back(static_cast<int64_t>(s));
      chunk_c0.push_back(c);
      chunk_c1.push_back(std::min(shard_cols[s + 1], c + kChunk));
    }
  at::parallel_for(0, static_cast<int64_t>(chunk_c0.size()), 2, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      for (int64_t g = 0; g < active; ++g) {
        const int64_t s = groups.slots[g], first = groups.start[g], n = groups.start[g + 1] - first;
        expand_rows(bp + s * R * N, N, R, bufp, SR, chunk_shard[item] * R, groups.order.data() + first, n, yp, ldy,
                    chunk_c0[item], chunk_c1[item]);
      }
    }
  });
}

}  // namespace

namespace kvrelay {

void lora_add(TensorArg y, TensorArg x, TensorArg a, TensorArg bt, TensorArg slots,
              const std::vector<int64_t>& shard_cols) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && bt.dim() == 3 && slots.dim() == 1,
              "lora_add: y [T, N], x [T, K], a [L, S*R, K], bt [L, R, N], slots [T]");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && bt.is_contiguous() && slots.is_contiguous(),
              "lora_add: x, a, bt and slots must be contiguous");
  TORCH_CHECK(y.stride(1) == 1, "lora_add: y's rows must be contiguous");
  TORCH_CHECK(x.size(0) == y.size(0) && slots.size(0) == x.size(0), "lora_add: x, y and slots differ in rows");
  TORCH_CHECK(a.size(2) == x.size(1) && a.size(0) == bt.size(0) && bt.size(2) == y.size(1),
              "lora_add: shapes of a, bt, x and y do not agree");
  TORCH_CHECK(slots.scalar_type() == at::kInt, "lora_add: slots must be int32");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type(),
              "lora_add: x, y, a and bt must share one dtype");
  const int64_t S = static_cast<int64_t>(shard_cols.size()) - 1;
  TORCH_CHECK(S >= 1 && a.size(1) == S * bt.size(1) && shard_cols.front() == 0 && shard_cols.back() == y.size(1),
              "lora_add: shard_cols must run from 0 to N, one shard per R rows of a");
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(shard_cols[s] <= shard_cols[s + 1], "lora_add: shard_cols descend");
  const int32_t* slot_of = slots.data_ptr<int32_t>();
  if (x.scalar_type() == at::kFloat) {
    lora_add_impl<float>(y, x, a, bt, slot_of, shard_cols);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_add: float32 or bfloat16 only");
    lora_add_impl<at::BFloat16>(y, x, a, bt, slot_of, shard_cols);
  }
}

}  // namespace kvrelay
