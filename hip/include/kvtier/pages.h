// Page gather/scatter between per-layer KV page pools and a page-first staging buffer.
//
// Layout (the copy engine's, hip/runtime/copy_engine.h): block i of `staging` holds page
// pages[i] of layer 0, then of layer 1, ... back to back:
//   staging + (i * num_layers + l) * page_bytes  <->  layer_ptrs[l] + pages[i] * page_stride_bytes
// Data moves as opaque words of word_bytes (16 when every address, the page size and the page
// stride allow it, else 8, 4, 2 or 1): bits are copied exactly, NaN payloads included.
// Bytes moved: 2 * num_blocks * num_layers * page_bytes; FLOPs: 0.
#pragma once

#include <cstdint>

#include "kvtier/compat.h"

namespace kvtier {

struct PageCopyParams {
  const std::uint64_t* layer_ptrs = nullptr;  // [num_layers] pool base addresses, readable where the copy runs
  const void* pages = nullptr;                // [num_blocks] page ids, int32 or int64 (pages_int64)
  void* staging = nullptr;                    // [num_blocks, num_layers, page_bytes] contiguous
  bool pages_int64 = false;
  std::int64_t num_blocks = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_pages = 0;          // pages per pool; ids outside [0, num_pages) are skipped
  std::int64_t page_bytes = 0;         // bytes of one page (contiguous)
  std::int64_t page_stride_bytes = 0;  // bytes between consecutive pages of a pool
  int word_bytes = 1;                  // 16, 8, 4, 2 or 1: see page_copy_word_bytes
};

// Widest word in {16, 8, 4, 2, 1} dividing page_bytes, page_stride_bytes, the staging address
// and every pool base address (host_layer_ptrs: the same addresses as layer_ptrs, on the host).
inline int page_copy_word_bytes(const std::uint64_t* host_layer_ptrs, std::int64_t num_layers, const void* staging,
                                std::int64_t page_bytes, std::int64_t page_stride_bytes) {
  std::uint64_t bits = static_cast<std::uint64_t>(page_bytes) | static_cast<std::uint64_t>(page_stride_bytes) |
                       reinterpret_cast<std::uint64_t>(staging);
  for (std::int64_t l = 0; l < num_layers; ++l) bits |= host_layer_ptrs[l];
  for (int word = 16; word > 1; word /= 2)
    if ((bits & static_cast<std::uint64_t>(word - 1)) == 0) return word;
  return 1;
}

// Reads page id i (int32 or int64) as int64.
KVTIER_HD inline std::int64_t page_id(const PageCopyParams& p, std::int64_t i) {
  return p.pages_int64 ? static_cast<const std::int64_t*>(p.pages)[i]
                       : static_cast<std::int64_t>(static_cast<const std::int32_t*>(p.pages)[i]);
}

// GPU launchers (hip/kernels/pages.hip): enqueue on `stream` (a hipStream_t / cudaStream_t).
// Throw std::invalid_argument on bad parameters, std::runtime_error on a failed launch.
void launch_gather_pages(const PageCopyParams& p, void* stream);
void launch_scatter_pages(const PageCopyParams& p, void* stream);

// CPU implementations of the same semantics (hip/cpu/pages_cpu.cpp).
void gather_pages_cpu(const PageCopyParams& p);
void scatter_pages_cpu(const PageCopyParams& p);

// Throws std::invalid_argument unless p is consistent (sizes >= 0, word_bytes divides the page
// size and stride, pointers set when there is work). Shared by the GPU and CPU entry points.
void check_page_copy_params(const PageCopyParams& p);

}  // namespace kvtier
