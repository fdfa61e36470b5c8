// Page gather/scatter kernels (see kvtier/pages.h for the layout).
//
// Grid: x = num_blocks * num_layers (one page of one layer), y = chunks of the page; each thread
// moves words (16-byte vectors when aligned) grid-stride within its chunk. One launch for the
// whole batch: no per-layer or per-page launches.
#include <stdexcept>
#include <string>

#include "kvtier/compat.h"
#include "kvtier/pages.h"

namespace kvtier {
namespace {

constexpr int kThreads = 256;
constexpr int kWordsPerThread = 4;  // words per thread per chunk: 16 KiB per block at 16-byte words

struct alignas(8) Word8 { std::uint32_t x, y; };

template <typename Word, bool kGather>
__global__ void __launch_bounds__(kThreads) page_copy_kernel(PageCopyParams p, std::int64_t words_per_chunk) {
  const std::int64_t flat = blockIdx.x;
  const std::int64_t block = flat / p.num_layers;
  const std::int64_t layer = flat - block * p.num_layers;
  const std::int64_t page = page_id(p, block);
  if (page < 0 || page >= p.num_pages) return;
  Word* pool = reinterpret_cast<Word*>(p.layer_ptrs[layer] + static_cast<std::uint64_t>(page * p.page_stride_bytes));
  Word* stage = reinterpret_cast<Word*>(static_cast<char*>(p.staging) + flat * p.page_bytes);
  const std::int64_t page_words = p.page_bytes / static_cast<std::int64_t>(sizeof(Word));
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * words_per_chunk;
  const std::int64_t end = begin + words_per_chunk < page_words ? begin + words_per_chunk : page_words;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    if (kGather) {
      stage[i] = pool[i];
    } else {
      pool[i] = stage[i];
    }
  }
}

template <typename Word, bool kGather>
void launch_typed(const PageCopyParams& p, hipStream_t stream) {
  const std::int64_t page_words = p.page_bytes / static_cast<std::int64_t>(sizeof(Word));
  const std::int64_t words_per_chunk = static_cast<std::int64_t>(kThreads) * kWordsPerThread;
  const std::int64_t chunks = (page_words + words_per_chunk - 1) / words_per_chunk;
  const std::int64_t pages = p.num_blocks * p.num_layers;
  if (pages > 0x7FFFFFFF || chunks > 65535)
    throw std::invalid_argument("page copy too large for one launch: " + std::to_string(pages) + " pages x " +
                                std::to_string(chunks) + " chunks");
  dim3 grid(static_cast<unsigned>(pages), static_cast<unsigned>(chunks));
  hipLaunchKernelGGL(HIP_KERNEL_NAME(page_copy_kernel<Word, kGather>), grid, dim3(kThreads), 0, stream, p,
                     words_per_chunk);
  check_launch(kGather ? "gather_pages" : "scatter_pages");
}

template <bool kGather>
void launch(const PageCopyParams& p, void* stream) {
  check_page_copy_params(p);
  if (p.num_blocks == 0 || p.num_layers == 0 || p.page_bytes == 0) return;
  hipStream_t s = static_cast<hipStream_t>(stream);
  switch (p.word_bytes) {
    case 16: return launch_typed<uint4, kGather>(p, s);
    case 8: return launch_typed<Word8, kGather>(p, s);
    case 4: return launch_typed<std::uint32_t, kGather>(p, s);
    case 2: return launch_typed<std::uint16_t, kGather>(p, s);
    default: return launch_typed<std::uint8_t, kGather>(p, s);
  }
}

}  // namespace

void launch_gather_pages(const PageCopyParams& p, void* stream) { launch<true>(p, stream); }
void launch_scatter_pages(const PageCopyParams& p, void* stream) { launch<false>(p, stream); }

}  // namespace kvtier
