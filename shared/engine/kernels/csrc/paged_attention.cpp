// Paged attention for a whole step on CPU: single-token decodes and multi-token chunks together, in one
// parallel region. Work items (attention.h) are handed out largest first, dynamically: context lengths differ a
// lot, and a static split would leave one thread with the long ones.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "api.h"
#include "common.h"
#include "vec.h"

namespace kvrelay {
namespace {

struct Item {
  int64_t cost;  // rows x keys, for the order
  int64_t r, token, n, pos, h0, nh;  // n == 0: a decode of kv heads [h0, h0 + nh)
};

std::vector<Item> plan(const int32_t* qsl, const int32_t* lens, int64_t reqs, int64_t decodes, int64_t kvh,
                       int64_t group, int64_t tile, int64_t threads) {
  std::vector<Item> items;
  // A whole request per decode item reads its blocks once, contiguously; with fewer decodes than threads,
  // split them by kv head so every thread has work.
  const int64_t per_item = decodes >= threads ? kvh : 1;
  for (int64_t r = 0; r < decodes; ++r)
    for (int64_t h = 0; h < kvh; h += per_item) items.push_back({lens[r] * per_item * group, r, qsl[r], 0, 0, h, per_item});
  for (int64_t r = decodes; r < reqs; ++r) {
    const int64_t n = qsl[r + 1] - qsl[r], pos0 = lens[r] - n;
    for (int64_t j = 0; j < n; j += tile)
      for (int64_t h = 0; h < kvh; ++h) {
        const int64_t m = std::min(tile, n - j);
        items.push_back({(pos0 + j + m) * m * group, r, qsl[r] + j, m, pos0 + j, h, 1});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

// Rows of new keys and values (k, v [tokens, kvh, d], strided rows) into their cache slots, in the cache's dtype.
template <typename T, typename N>
void write_row(const N* k, const N* v, int64_t slot, int64_t kvh, int64_t d, T* kc, T* vc) {
  if constexpr (std::is_same<T, Q8>::value) {  // per head row: its values, carrying their scales
    for (int64_t h = 0; h < kvh; ++h) {
      quantize_q8_row(k + h * d, d, kc + (slot * kvh + h) * d);
      quantize_q8_row(v + h * d, d, vc + (slot * kvh + h) * d);
    }
  } else {
    const int64_t width = kvh * d;
    for (int64_t i = 0; i < width; ++i) {
      put(kc + slot * width, i, load(k, i));
      put(vc + slot * width, i, load(v, i));
    }
  }
}

struct NewKV {
  const torch::Tensor* k;  // nullptr: the cache holds the step's keys and values already
  const torch::Tensor* v;
  const int64_t* slots;
};

template <typename T, typename Q>
void run(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const torch::Tensor& qsl,
         const torch::Tensor& lens, int64_t decodes, double scale, int64_t window, const NewKV& fresh,
         torch::Tensor& out) {
  AttnView<T, Q> a{};
  a.k = reinterpret_cast<const T*>(kv[0].data_ptr());
  a.v = reinterpret_cast<const T*>(kv[1].data_ptr());
  a.q = reinterpret_cast<const Q*>(q.data_ptr());
  a.out = reinterpret_cast<Q*>(out.data_ptr());
  a.tables = tables.data_ptr<int32_t>();
  a.table_stride = tables.size(1);
  a.q_stride = q.stride(0);
  a.bs = kv.size(2), a.kvh = kv.size(3), a.heads = q.size(1), a.d = q.size(2);
  a.scale = static_cast<float>(scale);
  a.window = window;
  const int threads = std::max(1, at::get_num_threads());
  int64_t tile = prefill_tile_tokens(a.group());
  if constexpr (std::is_same<T, at::BFloat16>::value && std::is_same<Q, at::BFloat16>::value) {
    if (const int64_t amx = prefill_tile_tokens_amx(a.d, a.group())) tile = amx;
  }
  const std::vector<Item> items = plan(qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), lens.size(0), decodes,
                                       a.kvh, a.group(), tile, threads);
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t tokens = q.size(0);
  T* kc = reinterpret_cast<T*>(kv[0].data_ptr());
  T* vc = reinterpret_cast<T*>(kv[1].data_ptr());
#pragma omp parallel num_threads(threads)
  {
    if (fresh.k != nullptr) {  // the step's new rows first; the barrier after this loop orders them before reads
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t ks = fresh.k->stride(0), vs = fresh.v->stride(0), slot = fresh.slots[t];
        if (fresh.k->scalar_type() == torch::kFloat32)
          write_row(fresh.k->data_ptr<float>() + t * ks, fresh.v->data_ptr<float>() + t * vs, slot, a.kvh, a.d,
                    kc, vc);
        else
          write_row(fresh.k->data_ptr<at::BFloat16>() + t * ks, fresh.v->data_ptr<at::BFloat16>() + t * vs, slot,
                    a.kvh, a.d, kc, vc);
      }
    }
    thread_local Scratch scratch;  // kept across steps: the pool's threads live as long as the process
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      if (it.n == 0) decode_item(a, it.r, it.token, lp[it.r], it.h0, it.nh, scratch);
      else prefill_item(a, it.r, it.token, it.n, it.pos, it.h0, scratch);
    }
  }
}

}  // namespace

// q [tokens, heads, d] fp32|bf16 (rows may be strided: a view of a fused qkv projection); kv_cache
// [2, num_blocks, bs, kvh, d] fp32|bf16|fp8 e4m3 (new rows rounded and saturated to it) or int8 (values carrying
// an fp16 scale per 32 of them: common.h); block_tables [reqs, max_blocks], query_start_loc [reqs + 1], seq_lens
// [reqs] int32, the first num_decodes requests with one query token each; window <= 0: full attention.
// k, v [tokens, kvh, d] (strided rows) and slot_mapping [tokens] int64: the step's new keys and values, written
// into the cache first (None: the cache holds them already). Returns [tokens, heads, d] in q's dtype.
torch::Tensor paged_attention(TensorArg q, OptTensorArg k, OptTensorArg v, TensorArg kv_cache,
                              OptTensorArg slot_mapping, TensorArg block_tables, TensorArg query_start_loc,
                              TensorArg seq_lens, int64_t num_decodes, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [tokens, heads, d] with contiguous heads");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, "q: float32 or bfloat16");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous [2, nb, bs, kvh, d]");
  const bool kq8 = kv_cache.scalar_type() == torch::kInt8;
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32 || kv_cache.scalar_type() == torch::kBFloat16 ||
                  kv_cache.scalar_type() == torch::kFloat8_e4m3fn || kq8,
              "kv_cache dtype must be float32, bfloat16, float8_e4m3fn or int8");
  TORCH_CHECK(kv_cache.size(4) == q.size(2) && q.size(1) % kv_cache.size(3) == 0,
              "head size must match and heads must be a multiple of kv heads");
  TORCH_CHECK(!kq8 || q.size(2) % kQ8Group == 0, "an int8 cache needs a head size that is a multiple of 32");
  TORCH_CHECK(q.size(2) <= 256, "head size above 256");
  for (const auto* t : {&block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "block tables, query starts, lengths: int32");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0),
              "one query start per request plus one, a block table row per request");
  TORCH_CHECK(num_decodes == seq_lens.size(0) || prefill_tile_tokens(1) > 0, "no native prefill on this CPU");
  NewKV fresh{nullptr, nullptr, nullptr};
  if (k.has_value()) {
    TORCH_CHECK(v.has_value() && slot_mapping.has_value(), "k needs v and slot_mapping");
    for (const auto* t : {&*k, &*v})
      TORCH_CHECK(t->dim() == 3 && t->size(0) == q.size(0) && t->size(1) == kv_cache.size(3) &&
                      t->size(2) == q.size(2) && t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                      t->scalar_type() == q.scalar_type(),
                  "k and v must be [tokens, kv heads, d] rows like q's, in q's dtype");
    TORCH_CHECK(slot_mapping->scalar_type() == torch::kInt64 && slot_mapping->is_contiguous() &&
                slot_mapping->numel() == q.size(0), "slot_mapping: int64, one slot per token");
    fresh = {&*k, &*v, slot_mapping->data_ptr<int64_t>()};
  }
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const bool kf32 = kv_cache.scalar_type() == torch::kFloat32, qf32 = q.scalar_type() == torch::kFloat32;
  const bool kfp8 = kv_cache.scalar_type() == torch::kFloat8_e4m3fn;
  auto go = [&](auto* tag_t, auto* tag_q) {
    using T = std::remove_pointer_t<decltype(tag_t)>;
    using Q = std::remove_pointer_t<decltype(tag_q)>;
    run<T, Q>(q, kv_cache, block_tables, query_start_loc, seq_lens, num_decodes, scale, window, fresh, out);
  };
  if (kq8 && qf32) go(static_cast<Q8*>(nullptr), static_cast<float*>(nullptr));
  else if (kq8) go(static_cast<Q8*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  else if (kfp8 && qf32) go(static_cast<Fp8*>(nullptr), static_cast<float*>(nullptr));
  else if (kfp8) go(static_cast<Fp8*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  else if (kf32 && qf32) go(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (kf32) go(static_cast<float*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  else if (qf32) go(static_cast<at::BFloat16*>(nullptr), static_cast<float*>(nullptr));
  else go(static_cast<at::BFloat16*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  return out;
}

// What this build's kernels use here: the vector unit, and whether multi-token chunks run natively.
std::string attention_isa() {
#if defined(KVRELAY_AVX512BF16)
  return "avx512-bf16";
#elif defined(KVRELAY_AVX512)
  return "avx512";
#elif defined(KVRELAY_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace kvrelay
