// CPU implementation of moe_align_block_size (hip/kernels/moe_align.hip): the same three phases
// over the same chunks and workspace, run sequentially.
#include <stdexcept>
#include <string>

#include "kvtier/moe_align.h"

namespace kvtier {

void check_moe_align_params(const MoeAlignParams& p) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("moe_align_block_size: " + msg); };
  if (p.num_experts < 1 || p.num_experts > kMoeAlignMaxExperts)
    fail("num_experts must be in [1, " + std::to_string(kMoeAlignMaxExperts) + "], got " +
         std::to_string(p.num_experts));
  if (p.block_m < 1) fail("block_m must be >= 1, got " + std::to_string(p.block_m));
  if (p.num_pairs < 0) fail("num_pairs must be >= 0, got " + std::to_string(p.num_pairs));
  if (moe_align_max_padded(p.num_pairs, p.num_experts, p.block_m) > 0x7FFFFFFF)
    fail("the padded length exceeds int32 (num_pairs " + std::to_string(p.num_pairs) + ")");
  if (!p.sorted_ids || !p.expert_ids || !p.num_padded || (p.num_pairs && (!p.topk_ids || !p.chunk_counts)))
    fail("topk_ids, sorted_ids, expert_ids, num_padded and chunk_counts must be set");
}

void moe_align_block_size_cpu(const MoeAlignParams& p) {
  check_moe_align_params(p);
  const std::int64_t num_chunks = moe_align_num_chunks(p.num_pairs);
  const std::int64_t num_experts = p.num_experts, block_m = p.block_m;
  // Phase 1: per-chunk histograms.
  for (std::int64_t i = 0; i < num_chunks * num_experts; ++i) p.chunk_counts[i] = 0;
  for (std::int64_t pair = 0; pair < p.num_pairs; ++pair) {
    const std::int32_t e = p.topk_ids[pair];
    if (e >= 0 && e < num_experts) ++p.chunk_counts[(pair / kMoeAlignChunk) * num_experts + e];
  }
  // Phase 2: padded offsets; chunk_counts becomes each chunk's first row per expert.
  std::int64_t start = 0;
  for (std::int64_t e = 0; e < num_experts; ++e) {
    std::int64_t row = start;
    for (std::int64_t c = 0; c < num_chunks; ++c) {
      std::int32_t& slot = p.chunk_counts[c * num_experts + e];
      const std::int32_t n = slot;
      slot = static_cast<std::int32_t>(row);
      row += n;
    }
    const std::int64_t padded = (row - start + block_m - 1) / block_m * block_m;
    for (std::int64_t r = row; r < start + padded; ++r) p.sorted_ids[r] = static_cast<std::int32_t>(p.num_pairs);
    for (std::int64_t b = start / block_m; b < (start + padded) / block_m; ++b)
      p.expert_ids[b] = static_cast<std::int32_t>(e);
    start += padded;
  }
  const std::int64_t max_padded = moe_align_max_padded(p.num_pairs, num_experts, block_m);
  for (std::int64_t r = start; r < max_padded; ++r) p.sorted_ids[r] = static_cast<std::int32_t>(p.num_pairs);
  for (std::int64_t b = start / block_m; b < max_padded / block_m; ++b) p.expert_ids[b] = -1;
  p.num_padded[0] = static_cast<std::int32_t>(start);
  // Phase 3: pairs in ascending order take consecutive rows of their chunk's range.
  for (std::int64_t pair = 0; pair < p.num_pairs; ++pair) {
    const std::int32_t e = p.topk_ids[pair];
    if (e < 0 || e >= num_experts) continue;
    std::int32_t& next = p.chunk_counts[(pair / kMoeAlignChunk) * num_experts + e];
    p.sorted_ids[next++] = static_cast<std::int32_t>(pair);
  }
}

}  // namespace kvtier
