// moe_align_block_size: sort the (token, choice) pairs of a routed batch by expert and pad each
// expert's rows to a multiple of block_m, the row layout of the grouped MoE GEMM.
//
// Input: topk_ids [num_pairs] int32 (a flattened [T, top_k]); pair index p = t * top_k + j.
// Outputs (the contract of kvtier.ops.moe_align_block_size):
//   sorted_ids [max_padded] int32: pair indices grouped by expert, ascending within an expert,
//     num_pairs in padding rows; expert e's rows start at start[e] = sum_{e' < e} padded[e'],
//     padded[e] = ceil(count[e] / block_m) * block_m;
//   expert_ids [max_padded / block_m] int32: expert of each row block, -1 past the used blocks;
//   num_padded [1] int32: sum_e padded[e].
// Ids outside [0, num_experts) are skipped (counted nowhere); the wrapper rejects them first.
//
// Algorithm (three launches, deterministic, no global atomics): the pairs are cut into chunks of
// kMoeAlignChunk; (1) per chunk, a histogram of its experts -> chunk_counts[c, e]; (2) one block
// turns the counts into padded expert offsets (a block scan over experts) and rewrites
// chunk_counts[c, e] into the first row of chunk c's pairs of expert e, writes expert_ids,
// num_padded and the padding rows; (3) per chunk, each pair's rank among the earlier pairs of its
// expert in the chunk gives its row. Bytes: ~ num_pairs * 12 + num_chunks * num_experts * 12.
#pragma once

#include <cstdint>

#include "kvtier/compat.h"

namespace kvtier {

constexpr int kMoeAlignChunk = 256;      // pairs per chunk (= threads per block of launches 1 and 3)
constexpr int kMoeAlignMaxExperts = 8192;  // shared-memory histogram bound (32 KiB)

struct MoeAlignParams {
  const std::int32_t* topk_ids = nullptr;  // [num_pairs]
  std::int32_t* sorted_ids = nullptr;      // [max_padded]
  std::int32_t* expert_ids = nullptr;      // [max_padded / block_m]
  std::int32_t* num_padded = nullptr;      // [1]
  std::int32_t* chunk_counts = nullptr;    // workspace [num_chunks, num_experts]
  std::int64_t num_pairs = 0;
  std::int32_t num_experts = 0;
  std::int32_t block_m = 0;
};

// ceil((num_pairs + num_experts * (block_m - 1)) / block_m) * block_m: the static bound on the
// padded length (every expert wastes at most block_m - 1 rows).
KVTIER_HD inline std::int64_t moe_align_max_padded(std::int64_t num_pairs, std::int64_t num_experts,
                                                   std::int64_t block_m) {
  return (num_pairs + num_experts * (block_m - 1) + block_m - 1) / block_m * block_m;
}

KVTIER_HD inline std::int64_t moe_align_num_chunks(std::int64_t num_pairs) {
  return (num_pairs + kMoeAlignChunk - 1) / kMoeAlignChunk;
}

// Elements of the int32 chunk_counts workspace.
KVTIER_HD inline std::int64_t moe_align_workspace_size(std::int64_t num_pairs, std::int64_t num_experts) {
  return moe_align_num_chunks(num_pairs) * num_experts;
}

// Throws std::invalid_argument unless num_pairs in [0, 2**31 - 1 - padding], num_experts in
// [1, kMoeAlignMaxExperts], block_m >= 1 and the pointers are set.
void check_moe_align_params(const MoeAlignParams& p);

// GPU launcher (hip/kernels/moe_align.hip) on `stream`; CPU implementation (hip/cpu/moe_align.cpp).
void launch_moe_align_block_size(const MoeAlignParams& p, void* stream);
void moe_align_block_size_cpu(const MoeAlignParams& p);

}  // namespace kvtier
