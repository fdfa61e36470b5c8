// moe_align_block_size kernels (see kvtier/moe_align.h for the contract and the algorithm).
#include <string>

#include "kvtier/compat.h"
#include "kvtier/moe_align.h"

namespace kvtier {
namespace {

constexpr int kScanThreads = 512;  // the single block of the offsets launch

// Launch 1: chunk_counts[c, e] = pairs of chunk c routed to expert e (a shared-memory histogram).
__global__ void __launch_bounds__(kMoeAlignChunk) moe_count_kernel(MoeAlignParams p) {
  KVTIER_DYNAMIC_SHARED(std::int32_t, counts);  // [num_experts]
  const int tid = threadIdx.x;
  for (int e = tid; e < p.num_experts; e += kMoeAlignChunk) counts[e] = 0;
  __syncthreads();
  const std::int64_t pair = static_cast<std::int64_t>(blockIdx.x) * kMoeAlignChunk + tid;
  if (pair < p.num_pairs) {
    const std::int32_t e = p.topk_ids[pair];
    if (e >= 0 && e < p.num_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  std::int32_t* out = p.chunk_counts + static_cast<std::int64_t>(blockIdx.x) * p.num_experts;
  for (int e = tid; e < p.num_experts; e += kMoeAlignChunk) out[e] = counts[e];
}

// Launch 2 (one block): padded expert offsets by a block scan; chunk_counts becomes each chunk's
// first row per expert; padding rows, expert_ids and num_padded are written here.
__global__ void __launch_bounds__(kScanThreads) moe_offsets_kernel(MoeAlignParams p, std::int64_t num_chunks) {
  __shared__ std::int64_t sums[kScanThreads];
  const int tid = threadIdx.x;
  const std::int64_t num_experts = p.num_experts, block_m = p.block_m;
  const std::int64_t per_thread = (num_experts + kScanThreads - 1) / kScanThreads;
  const std::int64_t e0 = tid * per_thread < num_experts ? tid * per_thread : num_experts;
  const std::int64_t e1 = e0 + per_thread < num_experts ? e0 + per_thread : num_experts;
  std::int64_t mine = 0;
  for (std::int64_t e = e0; e < e1; ++e) {
    std::int64_t count = 0;
    for (std::int64_t c = 0; c < num_chunks; ++c) count += p.chunk_counts[c * num_experts + e];
    mine += (count + block_m - 1) / block_m * block_m;
  }
  sums[tid] = mine;
  __syncthreads();
  for (int offset = 1; offset < kScanThreads; offset <<= 1) {  // inclusive Hillis-Steele scan
    const std::int64_t add = tid >= offset ? sums[tid - offset] : 0;
    __syncthreads();
    sums[tid] += add;
    __syncthreads();
  }
  const std::int64_t total_padded = sums[kScanThreads - 1];
  std::int64_t start = sums[tid] - mine;
  for (std::int64_t e = e0; e < e1; ++e) {
    std::int64_t row = start;
    for (std::int64_t c = 0; c < num_chunks; ++c) {
      std::int32_t* slot = p.chunk_counts + c * num_experts + e;
      const std::int32_t n = *slot;
      *slot = static_cast<std::int32_t>(row);
      row += n;
    }
    const std::int64_t padded = (row - start + block_m - 1) / block_m * block_m;
    for (std::int64_t r = row; r < start + padded; ++r) p.sorted_ids[r] = static_cast<std::int32_t>(p.num_pairs);
    for (std::int64_t b = start / block_m; b < (start + padded) / block_m; ++b)
      p.expert_ids[b] = static_cast<std::int32_t>(e);
    start += padded;
  }
  const std::int64_t max_padded = moe_align_max_padded(p.num_pairs, num_experts, block_m);
  for (std::int64_t r = total_padded + tid; r < max_padded; r += kScanThreads)
    p.sorted_ids[r] = static_cast<std::int32_t>(p.num_pairs);
  for (std::int64_t b = total_padded / block_m + tid; b < max_padded / block_m; b += kScanThreads) p.expert_ids[b] = -1;
  if (tid == 0) p.num_padded[0] = static_cast<std::int32_t>(total_padded);
}

// Launch 3: each pair goes to its chunk's first row of its expert plus its rank among the earlier
// pairs of the same expert in the chunk (ascending pair order within an expert).
__global__ void __launch_bounds__(kMoeAlignChunk) moe_scatter_kernel(MoeAlignParams p) {
  __shared__ std::int32_t ids[kMoeAlignChunk];
  const int tid = threadIdx.x;
  const std::int64_t pair = static_cast<std::int64_t>(blockIdx.x) * kMoeAlignChunk + tid;
  const std::int32_t e = pair < p.num_pairs ? p.topk_ids[pair] : -1;
  ids[tid] = e;
  __syncthreads();
  if (e < 0 || e >= p.num_experts) return;
  std::int32_t rank = 0;
  for (int j = 0; j < tid; ++j) rank += ids[j] == e;
  const std::int32_t first = p.chunk_counts[static_cast<std::int64_t>(blockIdx.x) * p.num_experts + e];
  p.sorted_ids[first + rank] = static_cast<std::int32_t>(pair);
}

}  // namespace

void launch_moe_align_block_size(const MoeAlignParams& p, void* stream) {
  check_moe_align_params(p);
  hipStream_t s = static_cast<hipStream_t>(stream);
  const std::int64_t num_chunks = moe_align_num_chunks(p.num_pairs);
  const std::size_t hist_bytes = static_cast<std::size_t>(p.num_experts) * sizeof(std::int32_t);
  if (num_chunks > 0) {
    hipLaunchKernelGGL(moe_count_kernel, dim3(static_cast<unsigned>(num_chunks)), dim3(kMoeAlignChunk), hist_bytes, s,
                       p);
    check_launch("moe_align_block_size (count)");
  }
  hipLaunchKernelGGL(moe_offsets_kernel, dim3(1), dim3(kScanThreads), 0, s, p, num_chunks);
  check_launch("moe_align_block_size (offsets)");
  if (num_chunks > 0) {
    hipLaunchKernelGGL(moe_scatter_kernel, dim3(static_cast<unsigned>(num_chunks)), dim3(kMoeAlignChunk), 0, s, p);
    check_launch("moe_align_block_size (scatter)");
  }
}

}  // namespace kvtier
