// Paged MLA decode (weight-absorbed: one latent KV head shared by all query heads), split-KV.
//
// For sequence b and head h, over the L = seq_lens[b] cached rows kv[t] (width dim =
// kv_lora_rank + rope_dim, token t at kv_cache[block_table[b, t / page_size], t % page_size]):
//   s_t = (q[b, h] . kv[t]) * sm_scale * kv_scale,  out = sum_t softmax(s)_t * kv[t, :kv_lora_rank] * kv_scale,
//   lse = log(sum_t exp(s_t)) (natural log); L = 0 gives out = 0, lse = +inf.
// Split-KV: the L tokens are cut into num_splits contiguous slices of ceil(L / num_splits)
// (mla_split_range); stage 1 computes each slice's normalised output and log-sum-exp into the
// fp32 workspace (part_out, part_lse; an empty slice has lse -inf), stage 2 merges the slices of
// each (b, h) by their log-sum-exp (mla_merge_row). Source of the merge: FlashDecoding /
// FlashInfer's merge_state (o = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m), m = max_s lse_s).
// Only tokens t < seq_lens[b] are read: block_table entries past the last used page and cache
// slots past the end are never addressed (they may hold anything, e.g. NaN or 2**31 - 1).
// Bytes (decode, per sequence): L*dim cache + H*dim q + H*kv_lora_rank out, plus the workspace
// 2*H*num_splits*(kv_lora_rank + 1)*4; FLOPs: 2*H*L*(dim + kv_lora_rank).
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kvtier/compat.h"
#include "kvtier/numeric.h"

namespace kvtier {

// Widths the GPU kernel holds in registers (K2 / DeepSeek-V3: 512 + 64); smaller widths work too.
constexpr int kMlaMaxDim = 576;
constexpr int kMlaMaxRank = 512;
constexpr int kMlaMaxSplits = 256;

struct MlaDecodeParams {
  const void* q = nullptr;                  // [batch, num_heads, dim] q_dtype; q_stride_d == 1
  const void* kv_cache = nullptr;           // [num_pages, page_size, dim] kv_dtype; kv_stride_d == 1
  const std::int32_t* block_table = nullptr;  // [batch, max_pages] page ids
  const std::int32_t* seq_lens = nullptr;   // [batch] tokens per sequence (0 allowed)
  void* out = nullptr;                      // [batch, num_heads, kv_lora_rank] q_dtype; out_stride_d == 1
  float* lse = nullptr;                     // [batch, num_heads] fp32 contiguous
  float* part_out = nullptr;                // workspace [batch, num_heads, num_splits, kv_lora_rank] fp32
  float* part_lse = nullptr;                // workspace [batch, num_heads, num_splits] fp32
  std::int64_t q_stride_b = 0, q_stride_h = 0;                // in elements
  std::int64_t kv_stride_page = 0, kv_stride_slot = 0;        // in elements
  std::int64_t block_table_stride_b = 0;                      // in elements
  std::int64_t out_stride_b = 0, out_stride_h = 0;            // in elements
  std::int32_t batch = 0, num_heads = 0, dim = 0, kv_lora_rank = 0;
  std::int32_t page_size = 0, max_pages = 0, num_pages = 0, num_splits = 1;
  float sm_scale = 1.0f;
  float kv_scale = 1.0f;  // the cache holds kv / kv_scale (fp8); 1 otherwise
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Tokens [*start, *end) of slice `split` of a sequence of seq_len tokens.
KVTIER_HD inline void mla_split_range(int seq_len, int num_splits, int split, int* start, int* end) {
  const int len = (seq_len + num_splits - 1) / num_splits;
  const long long s = static_cast<long long>(split) * len;
  *start = s < seq_len ? static_cast<int>(s) : seq_len;
  *end = s + len < seq_len ? static_cast<int>(s + len) : seq_len;
}

// Stage 2 for one (b, h): columns c = c_begin, c_begin + c_step, ... < kv_lora_rank of out_row
// from the slices part_out_row [num_splits, kv_lora_rank] weighted by exp(part_lse_row[s] - max);
// returns the merged lse (+inf when no slice has keys; out is 0 then).
template <typename OutT>
KVTIER_HD inline float mla_merge_row(const float* part_out_row, const float* part_lse_row, int num_splits,
                                     int kv_lora_rank, int c_begin, int c_step,
                                     typename OutT::storage* out_row) {
  float peak = -__builtin_huge_valf();
  for (int s = 0; s < num_splits; ++s) peak = part_lse_row[s] > peak ? part_lse_row[s] : peak;
  const bool has_keys = peak > -__builtin_huge_valf();
  float total = 0.0f;
  for (int s = 0; s < num_splits; ++s) total += has_keys ? expf(part_lse_row[s] - peak) : 0.0f;
  const float inv = has_keys ? 1.0f / total : 0.0f;
  for (int c = c_begin; c < kv_lora_rank; c += c_step) {
    float acc = 0.0f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = has_keys ? expf(part_lse_row[s] - peak) : 0.0f;
      if (w != 0.0f) acc += w * part_out_row[static_cast<long long>(s) * kv_lora_rank + c];
    }
    out_row[c] = OutT::from_float(acc * inv);
  }
  return has_keys ? peak + logf(total) : __builtin_huge_valf();
}

// Calls f(QT{}, KVT{}) with the type tags of a supported (q_dtype, kv_dtype) pair: (fp32, fp32),
// (fp16, fp16), (bf16, bf16), (bf16, e4m3fn), (bf16, e4m3fnuz); throws std::invalid_argument otherwise.
template <typename F>
void visit_mla_dtypes(DType q, DType kv, F&& f) {
  if (q == DType::kFloat32 && kv == DType::kFloat32) return f(F32{}, F32{});
  if (q == DType::kFloat16 && kv == DType::kFloat16) return f(F16{}, F16{});
  if (q == DType::kBFloat16 && kv == DType::kBFloat16) return f(BF16{}, BF16{});
  if (q == DType::kBFloat16 && kv == DType::kFloat8E4M3FN) return f(BF16{}, E4M3FN{});
  if (q == DType::kBFloat16 && kv == DType::kFloat8E4M3FNUZ) return f(BF16{}, E4M3FNUZ{});
  throw std::invalid_argument("mla_decode: unsupported (q_dtype, kv_dtype) codes (" +
                              std::to_string(static_cast<int>(q)) + ", " + std::to_string(static_cast<int>(kv)) +
                              "); supported: (fp32, fp32), (fp16, fp16), (bf16, bf16), (bf16, fp8 e4m3fn / e4m3fnuz)");
}

// Throws std::invalid_argument naming the field unless p is consistent (sizes, widths within
// kMlaMaxDim / kMlaMaxRank, num_splits in [1, kMlaMaxSplits], unit inner strides, pointers set).
void check_mla_decode_params(const MlaDecodeParams& p);

// GPU launcher (hip/kernels/mla_decode.hip) on `stream`: stage 1 and stage 2, for the dtype
// pairs of visit_mla_dtypes.
void launch_mla_decode(const MlaDecodeParams& p, void* stream);
// Query heads per stage-1 block of the GPU kernel (8 on CDNA, 16 on NVIDIA): the split planner's input.
int mla_decode_heads_per_block();
// CPU implementation of the same two stages (hip/cpu/mla_decode.cpp), same dtype pairs.
void mla_decode_cpu(const MlaDecodeParams& p);

}  // namespace kvtier
