// Device code of the split-KV paged MLA decode (contract in kvtier/mla_decode.h). Included by
// the per-dtype instantiation files hip/kernels/instantiations/mla_decode_*.hip only.
//
// Stage 1, grid (head blocks, num_splits, batch), kMlaThreads threads = kMlaWarps warps:
//   - one block takes kMlaHeadsPerBlock heads of one sequence and one key slice; consecutive
//     blocks are the head blocks of the same slice, so the slice's cache rows are read from DRAM
//     once and from L2 by the other head blocks;
//   - per tile of kMlaBlockN tokens, the block copies the rows (gathered through block_table)
//     into shared memory in the cache's own dtype, with 16-byte vector loads when the rows allow
//     (else element by element); rows past the slice are zero-filled, never loaded;
//   - each warp owns kMlaHeadsPerWarp heads; lane l holds q elements l, l + W, ... (pre-scaled by
//     sm_scale * kv_scale * log2(e)) and output columns l, l + W, ... (W = 64 on CDNA, 32 on
//     NVIDIA); a score is a per-lane partial dot plus a butterfly warp sum; online softmax in
//     base 2 over the tiles, fp32 throughout.
// Stage 2, grid (num_heads, batch), kMlaMergeThreads threads: mla_merge_row per (b, h).
#pragma once

#include "kvtier/compat.h"
#include "kvtier/mla_decode.h"
#include "kvtier/numeric.h"

namespace kvtier {

// Launch shape per vendor, chosen from the compilers' resource reports at K2 widths (bf16 and
// fp8 caches, no spills): CDNA ~186 VGPRs (2 waves per SIMD), NVIDIA <= 128 registers (2 blocks
// per SM). Not yet tuned by measurement.
constexpr int kMlaWarps = kWarpSize == 64 ? 4 : 8;
constexpr int kMlaHeadsPerWarp = 2;
constexpr int kMlaHeadsPerBlock = kMlaWarps * kMlaHeadsPerWarp;  // 8 on CDNA, 16 on NVIDIA
constexpr int kMlaThreads = kMlaWarps * kWarpSize;               // 256 on both
constexpr int kMlaBlockN = kWarpSize == 64 ? 16 : 8;             // tokens per shared-memory tile
#if defined(KVTIER_GPU_CUDA)
#define KVTIER_MLA_LAUNCH_BOUNDS __launch_bounds__(kMlaThreads, 2)
#else
#define KVTIER_MLA_LAUNCH_BOUNDS __launch_bounds__(kMlaThreads)
#endif
constexpr int kMlaDimPerLane = (kMlaMaxDim + kWarpSize - 1) / kWarpSize;
constexpr int kMlaRankPerLane = (kMlaMaxRank + kWarpSize - 1) / kWarpSize;
constexpr int kMlaMergeThreads = 128;

template <typename KVT>
struct MlaTile {
  using T = typename KVT::storage;
  static constexpr int kRowElems = kMlaMaxDim;  // row pitch in shared memory
  static_assert(kRowElems * sizeof(T) % 16 == 0, "shared rows must stay 16-byte aligned");
};

// Copies rows [0, rows) of the tile (token n0 + r) into shared memory; zero-fills rows [rows, kMlaBlockN).
template <typename KVT>
KVTIER_DEVICE_INLINE void mla_load_tile(const MlaDecodeParams& p, typename KVT::storage* tile,
                                             const typename KVT::storage** row_ptr, const std::int32_t* bt_row,
                                             int n0, int rows, bool vec) {
  using T = typename KVT::storage;
  constexpr int kPitch = MlaTile<KVT>::kRowElems;
  const int tid = threadIdx.x;
  if (tid < rows) {
    const int n = n0 + tid;
    const std::int64_t page = bt_row[n / p.page_size];
    row_ptr[tid] = static_cast<const T*>(p.kv_cache) + page * p.kv_stride_page + (n % p.page_size) * p.kv_stride_slot;
  }
  __syncthreads();
  if (vec) {
    const int vecs = p.dim * static_cast<int>(sizeof(T)) / 16;
    for (int i = tid; i < rows * vecs; i += kMlaThreads) {
      const int r = i / vecs, v = i - r * vecs;
      reinterpret_cast<uint4*>(tile + r * kPitch)[v] = reinterpret_cast<const uint4*>(row_ptr[r])[v];
    }
  } else {
    for (int i = tid; i < rows * p.dim; i += kMlaThreads) {
      const int r = i / p.dim, d = i - r * p.dim;
      tile[r * kPitch + d] = row_ptr[r][d];
    }
  }
  for (int i = rows * kPitch + tid; i < kMlaBlockN * kPitch; i += kMlaThreads) tile[i] = T(0);
}

template <typename QT, typename KVT>
__global__ void KVTIER_MLA_LAUNCH_BOUNDS mla_decode_partial_kernel(MlaDecodeParams p, bool vec) {
  using T = typename KVT::storage;
  constexpr int kPitch = MlaTile<KVT>::kRowElems;
  __shared__ T tile[kMlaBlockN * kPitch] __attribute__((aligned(16)));
  __shared__ const T* row_ptr[kMlaBlockN];

  const int head_block = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int h0 = head_block * kMlaHeadsPerBlock + warp * kMlaHeadsPerWarp;
  int start = 0, end = 0;
  mla_split_range(p.seq_lens[b], p.num_splits, split, &start, &end);

  const float q_scale = p.sm_scale * p.kv_scale * kLog2e;  // scores in log2 units
  float qreg[kMlaHeadsPerWarp][kMlaDimPerLane];
  float acc[kMlaHeadsPerWarp][kMlaRankPerLane];
  float m[kMlaHeadsPerWarp], l[kMlaHeadsPerWarp];
#pragma unroll
  for (int i = 0; i < kMlaHeadsPerWarp; ++i) {
    const int h = h0 + i;
    const auto* q_row = static_cast<const typename QT::storage*>(p.q) + b * p.q_stride_b + h * p.q_stride_h;
#pragma unroll
    for (int k = 0; k < kMlaDimPerLane; ++k) {
      const int d = lane + k * kWarpSize;
      qreg[i][k] = (h < p.num_heads && d < p.dim) ? QT::to_float(q_row[d]) * q_scale : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kMlaRankPerLane; ++k) acc[i][k] = 0.0f;
    m[i] = -__builtin_huge_valf();
    l[i] = 0.0f;
  }

  const std::int32_t* bt_row = p.block_table + b * p.block_table_stride_b;
  for (int n0 = start; n0 < end; n0 += kMlaBlockN) {
    const int rows = end - n0 < kMlaBlockN ? end - n0 : kMlaBlockN;
    __syncthreads();  // the previous tile is consumed
    mla_load_tile<KVT>(p, tile, row_ptr, bt_row, n0, rows, vec);
    __syncthreads();

    float s[kMlaHeadsPerWarp][kMlaBlockN];
#pragma unroll
    for (int i = 0; i < kMlaHeadsPerWarp; ++i)
#pragma unroll
      for (int n = 0; n < kMlaBlockN; ++n) s[i][n] = 0.0f;
#pragma unroll
    for (int n = 0; n < kMlaBlockN; ++n) {
#pragma unroll
      for (int k = 0; k < kMlaDimPerLane; ++k) {
        const int d = lane + k * kWarpSize;
        if (d < p.dim) {
          const float kv = KVT::to_float(tile[n * kPitch + d]);
#pragma unroll
          for (int i = 0; i < kMlaHeadsPerWarp; ++i) s[i][n] += qreg[i][k] * kv;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kMlaHeadsPerWarp; ++i) {
      float m_new = m[i];
#pragma unroll
      for (int n = 0; n < kMlaBlockN; ++n) {
        s[i][n] = n < rows ? warp_allreduce_sum(s[i][n]) : -__builtin_huge_valf();
        m_new = s[i][n] > m_new ? s[i][n] : m_new;
      }
      const float alpha = fast_exp2(m[i] - m_new);  // 0 on the first tile (m = -inf)
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kMlaBlockN; ++n) {
        s[i][n] = n < rows ? fast_exp2(s[i][n] - m_new) : 0.0f;
        sum += s[i][n];
      }
      l[i] = l[i] * alpha + sum;
      m[i] = m_new;
#pragma unroll
      for (int k = 0; k < kMlaRankPerLane; ++k) acc[i][k] *= alpha;
    }
#pragma unroll
    for (int n = 0; n < kMlaBlockN; ++n) {
#pragma unroll
      for (int k = 0; k < kMlaRankPerLane; ++k) {
        const int c = lane + k * kWarpSize;
        if (c < p.kv_lora_rank) {
          const float kv = KVT::to_float(tile[n * kPitch + c]);
#pragma unroll
          for (int i = 0; i < kMlaHeadsPerWarp; ++i) acc[i][k] += s[i][n] * kv;
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kMlaHeadsPerWarp; ++i) {
    const int h = h0 + i;
    if (h >= p.num_heads) continue;
    const std::int64_t row = (static_cast<std::int64_t>(b) * p.num_heads + h) * p.num_splits + split;
    const bool nonempty = l[i] > 0.0f;
    const float scale = nonempty ? p.kv_scale / l[i] : 0.0f;
    float* out = p.part_out + row * p.kv_lora_rank;
#pragma unroll
    for (int k = 0; k < kMlaRankPerLane; ++k) {
      const int c = lane + k * kWarpSize;
      if (c < p.kv_lora_rank) out[c] = acc[i][k] * scale;
    }
    if (lane == 0) p.part_lse[row] = nonempty ? (m[i] + fast_log2(l[i])) * kLn2 : -__builtin_huge_valf();
  }
}

template <typename QT>
__global__ void __launch_bounds__(kMlaMergeThreads) mla_decode_merge_kernel(MlaDecodeParams p) {
  const int h = blockIdx.x, b = blockIdx.y;
  const std::int64_t row = static_cast<std::int64_t>(b) * p.num_heads + h;
  auto* out_row = static_cast<typename QT::storage*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
  const float lse = mla_merge_row<QT>(p.part_out + row * p.num_splits * p.kv_lora_rank, p.part_lse + row * p.num_splits,
                                      p.num_splits, p.kv_lora_rank, threadIdx.x, kMlaMergeThreads, out_row);
  if (threadIdx.x == 0) p.lse[row] = lse;
}

// Launches both stages for one (q, kv) dtype pair; parameters already checked.
template <typename QT, typename KVT>
void launch_mla_decode_typed(const MlaDecodeParams& p, hipStream_t stream) {
  using T = typename KVT::storage;
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(p.kv_cache);
  const std::int64_t es = sizeof(T);
  const bool vec = base % 16 == 0 && (p.dim * es) % 16 == 0 && (p.kv_stride_page * es) % 16 == 0 &&
                   (p.kv_stride_slot * es) % 16 == 0;
  const int head_blocks = (p.num_heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock;
  hipLaunchKernelGGL(HIP_KERNEL_NAME(mla_decode_partial_kernel<QT, KVT>), dim3(head_blocks, p.num_splits, p.batch),
                     dim3(kMlaThreads), 0, stream, p, vec);
  check_launch("mla_decode (partial)");
  hipLaunchKernelGGL(HIP_KERNEL_NAME(mla_decode_merge_kernel<QT>), dim3(p.num_heads, p.batch), dim3(kMlaMergeThreads), 0,
                     stream, p);
  check_launch("mla_decode (merge)");
}

}  // namespace kvtier
