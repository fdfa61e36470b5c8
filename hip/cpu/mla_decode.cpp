// CPU implementation of the split-KV paged MLA decode (hip/kernels/mla_decode.hip): the same
// slices (mla_split_range), fp32 partial softmax per slice in base 2, the same workspace and the
// same merge (mla_merge_row). Unlike the GPU kernel it also checks every block_table entry it
// reads (std::out_of_range), so a bad table fails loudly here instead of reading stray memory.
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvtier/mla_decode.h"

namespace kvtier {

void check_mla_decode_params(const MlaDecodeParams& p) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("mla_decode: " + msg); };
  auto num = [](long long v) { return std::to_string(v); };
  if (p.batch < 0 || p.num_heads < 0) fail("batch and num_heads must be >= 0");
  if (p.dim < 2 || p.dim > kMlaMaxDim) fail("dim must be in [2, " + num(kMlaMaxDim) + "], got " + num(p.dim));
  if (p.kv_lora_rank < 1 || p.kv_lora_rank >= p.dim || p.kv_lora_rank > kMlaMaxRank)
    fail("kv_lora_rank must be in [1, min(dim - 1, " + num(kMlaMaxRank) + ")], got " + num(p.kv_lora_rank));
  if (p.page_size < 1) fail("page_size must be >= 1, got " + num(p.page_size));
  if (p.max_pages < 0 || p.num_pages < 0) fail("max_pages and num_pages must be >= 0");
  if (p.num_splits < 1 || p.num_splits > kMlaMaxSplits)
    fail("num_splits must be in [1, " + num(kMlaMaxSplits) + "], got " + num(p.num_splits));
  if (!(p.kv_scale > 0.0f) || !std::isfinite(p.kv_scale)) fail("kv_scale must be finite and > 0");
  if (!std::isfinite(p.sm_scale)) fail("sm_scale must be finite");
  if (p.batch && p.num_heads &&
      (!p.q || !p.kv_cache || !p.block_table || !p.seq_lens || !p.out || !p.lse || !p.part_out || !p.part_lse))
    fail("q, kv_cache, block_table, seq_lens, out, lse, part_out and part_lse must be set");
  visit_mla_dtypes(p.q_dtype, p.kv_dtype, [](auto, auto) {});
}

namespace {

// Rows [start, end) of sequence b as fp32 (cache values, not yet times kv_scale).
template <typename KVT>
std::vector<float> gather_rows(const MlaDecodeParams& p, int b, int start, int end) {
  using T = typename KVT::storage;
  std::vector<float> rows(static_cast<std::size_t>(end - start) * p.dim);
  const std::int32_t* bt_row = p.block_table + b * p.block_table_stride_b;
  for (int t = start; t < end; ++t) {
    const std::int32_t page = bt_row[t / p.page_size];
    if (page < 0 || page >= p.num_pages)
      throw std::out_of_range("mla_decode: block_table[" + std::to_string(b) + ", " + std::to_string(t / p.page_size) +
                              "] = " + std::to_string(page) + " is outside [0, num_pages=" +
                              std::to_string(p.num_pages) + ")");
    const T* src = static_cast<const T*>(p.kv_cache) + page * p.kv_stride_page + (t % p.page_size) * p.kv_stride_slot;
    for (int d = 0; d < p.dim; ++d) rows[static_cast<std::size_t>(t - start) * p.dim + d] = KVT::to_float(src[d]);
  }
  return rows;
}

// Stage 1 for one (b, slice): every head's normalised slice output and log-sum-exp.
template <typename QT, typename KVT>
void partial(const MlaDecodeParams& p, int b, int split) {
  int start = 0, end = 0;
  mla_split_range(p.seq_lens[b], p.num_splits, split, &start, &end);
  const std::vector<float> rows = gather_rows<KVT>(p, b, start, end);
  const int n = end - start;
  const float q_scale = p.sm_scale * p.kv_scale * kLog2e;
  std::vector<float> score(static_cast<std::size_t>(n)), q(static_cast<std::size_t>(p.dim));
  for (int h = 0; h < p.num_heads; ++h) {
    const auto* q_row = static_cast<const typename QT::storage*>(p.q) + b * p.q_stride_b + h * p.q_stride_h;
    for (int d = 0; d < p.dim; ++d) q[d] = QT::to_float(q_row[d]) * q_scale;
    float peak = -INFINITY;
    for (int t = 0; t < n; ++t) {
      float dot = 0.0f;
      for (int d = 0; d < p.dim; ++d) dot += q[d] * rows[static_cast<std::size_t>(t) * p.dim + d];
      score[t] = dot;
      peak = std::fmax(peak, dot);
    }
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) sum += score[t] = std::exp2(score[t] - peak);
    const std::int64_t row = (static_cast<std::int64_t>(b) * p.num_heads + h) * p.num_splits + split;
    float* out = p.part_out + row * p.kv_lora_rank;
    const float scale = sum > 0.0f ? p.kv_scale / sum : 0.0f;
    for (int c = 0; c < p.kv_lora_rank; ++c) {
      float acc = 0.0f;
      for (int t = 0; t < n; ++t) acc += score[t] * rows[static_cast<std::size_t>(t) * p.dim + c];
      out[c] = acc * scale;
    }
    p.part_lse[row] = sum > 0.0f ? (peak + std::log2(sum)) * kLn2 : -INFINITY;
  }
}

template <typename QT, typename KVT>
void run(const MlaDecodeParams& p) {
  for (int b = 0; b < p.batch; ++b) {
    const int seq_len = p.seq_lens[b];
    if (seq_len < 0 || static_cast<std::int64_t>(seq_len) > static_cast<std::int64_t>(p.max_pages) * p.page_size)
      throw std::out_of_range("mla_decode: seq_lens[" + std::to_string(b) + "] = " + std::to_string(seq_len) +
                              " is outside [0, max_pages * page_size]");
    for (int split = 0; split < p.num_splits; ++split) partial<QT, KVT>(p, b, split);
  }
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.num_heads; ++h) {
      const std::int64_t row = static_cast<std::int64_t>(b) * p.num_heads + h;
      auto* out_row = static_cast<typename QT::storage*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
      p.lse[row] = mla_merge_row<QT>(p.part_out + row * p.num_splits * p.kv_lora_rank, p.part_lse + row * p.num_splits,
                                     p.num_splits, p.kv_lora_rank, 0, 1, out_row);
    }
  }
}

}  // namespace

void mla_decode_cpu(const MlaDecodeParams& p) {
  check_mla_decode_params(p);
  if (p.batch == 0 || p.num_heads == 0) return;
  visit_mla_dtypes(p.q_dtype, p.kv_dtype, [&](auto qt, auto kvt) { run<decltype(qt), decltype(kvt)>(p); });
}

}  // namespace kvtier
