// What the paged attention kernels share: a view of one layer's paged KV cache and of the step's queries,
// and the two kinds of work item (paged_attention.cpp hands them out to the threads):
//   decode_item   one single-token request (or some of its kv heads): paged_decode.cpp
//   prefill_item  one tile of a multi-token chunk's query tokens for one kv head: paged_prefill.cpp
#pragma once

#include <cstdint>
#include <vector>

namespace kvrelay {

// Rows of consecutive positions of one request and kv head, walked through its block table without a division
// per row. The next block's id is read only when a row of it is asked for.
template <typename T>
class RowCursor {
 public:
  RowCursor(const T* cache, const int32_t* table, int64_t pos, int64_t bs, int64_t token_stride, int64_t head_offset)
      : cache_(cache), table_(table), bs_(bs), ts_(token_stride), head_(head_offset), b_(pos / bs), o_(pos % bs) {}
  const T* next() {
    if (blk_ == nullptr) blk_ = cache_ + (int64_t(table_[b_]) * bs_) * ts_ + head_;
    const T* p = blk_ + o_ * ts_;
    if (++o_ == bs_) {
      o_ = 0;
      ++b_;
      blk_ = nullptr;
    }
    return p;
  }

 private:
  const T* cache_;
  const int32_t* table_;
  int64_t bs_, ts_, head_, b_, o_;
  const T* blk_ = nullptr;
};

template <typename T, typename Q>
struct AttnView {
  const T* k;          // keys of block 0, token 0, kv head 0: [num_blocks, bs, kvh, d]
  const T* v;          // values, same layout
  const Q* q;          // query rows [tokens, heads, d] (rows may be strided: q_stride elements apart)
  Q* out;              // [tokens, heads, d], contiguous
  const int32_t* tables;
  int64_t table_stride;
  int64_t q_stride;
  int64_t bs, kvh, heads, d;
  float scale;
  int64_t window;      // <= 0: full attention

  int64_t group() const { return heads / kvh; }
  int64_t token_stride() const { return kvh * d; }
  RowCursor<T> rows(const T* cache, const int32_t* table, int64_t pos, int64_t h) const {
    return RowCursor<T>(cache, table, pos, bs, token_stride(), h * d);
  }
  // The row of position pos, kv head h (one lookup; rows() walks many).
  const T* row(const T* cache, const int32_t* table, int64_t pos, int64_t h) const {
    return cache + (int64_t(table[pos / bs]) * bs + pos % bs) * token_stride() + h * d;
  }
};

// Per-thread buffers, grown on first use and kept for the step.
struct Scratch {
  std::vector<float> f[8];
  std::vector<uint32_t> u[5];
  float* floats(int i, int64_t n) {
    if (int64_t(f[i].size()) < n) f[i].resize(n);
    return f[i].data();
  }
  uint32_t* units(int i, int64_t n) {
    if (int64_t(u[i].size()) < n) u[i].resize(n);
    return u[i].data();
  }
};

// Request r (query row `token`, context seq_len) for kv heads [h0, h0 + nh).
template <typename T, typename Q>
void decode_item(const AttnView<T, Q>& a, int64_t r, int64_t token, int64_t seq_len, int64_t h0, int64_t nh,
                 Scratch& s);

// Query tokens [tok0, tok0 + n) of request r, the first at position pos0, kv head h.
template <typename T, typename Q>
void prefill_item(const AttnView<T, Q>& a, int64_t r, int64_t tok0, int64_t n, int64_t pos0, int64_t h, Scratch& s);

// Query tokens per prefill tile for a group of `group` query heads per kv head.
int64_t prefill_tile_tokens(int64_t group);
// The same for the AMX tiles (bf16 cache and queries; 0 where they do not take the item).
int64_t prefill_tile_tokens_amx(int64_t d, int64_t group);

}  // namespace kvrelay
