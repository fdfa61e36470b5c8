// CPU implementation of the page gather/scatter kernels (hip/kernels/pages.hip): the same
// parameters, the same word size and the same skipping of out-of-range page ids.
#include <cstring>
#include <stdexcept>
#include <string>

#include "kvtier/pages.h"

namespace kvtier {

void check_page_copy_params(const PageCopyParams& p) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("page copy: " + msg); };
  if (p.num_blocks < 0 || p.num_layers < 0 || p.num_pages < 0 || p.page_bytes < 0)
    fail("num_blocks, num_layers, num_pages and page_bytes must be >= 0");
  if (p.page_stride_bytes < p.page_bytes)
    fail("page_stride_bytes (" + std::to_string(p.page_stride_bytes) + ") must be >= page_bytes (" +
         std::to_string(p.page_bytes) + ")");
  const int w = p.word_bytes;
  if (w != 1 && w != 2 && w != 4 && w != 8 && w != 16)
    fail("word_bytes must be 1, 2, 4, 8 or 16, got " + std::to_string(w));
  if (p.page_bytes % w || p.page_stride_bytes % w || reinterpret_cast<std::uintptr_t>(p.staging) % w)
    fail("word_bytes " + std::to_string(w) + " must divide page_bytes, page_stride_bytes and the staging address");
  if (p.num_blocks && p.num_layers && p.page_bytes && (!p.layer_ptrs || !p.pages || !p.staging))
    fail("layer_ptrs, pages and staging must be set");
}

namespace {

template <bool kGather>
void run(const PageCopyParams& p) {
  check_page_copy_params(p);
  const std::int64_t n = p.page_bytes;
  for (std::int64_t block = 0; block < p.num_blocks; ++block) {
    const std::int64_t page = page_id(p, block);
    if (page < 0 || page >= p.num_pages) continue;
    for (std::int64_t layer = 0; layer < p.num_layers; ++layer) {
      auto* pool = reinterpret_cast<char*>(p.layer_ptrs[layer] + static_cast<std::uint64_t>(page * p.page_stride_bytes));
      char* stage = static_cast<char*>(p.staging) + (block * p.num_layers + layer) * p.page_bytes;
      char* dst = kGather ? stage : pool;
      const char* src = kGather ? pool : stage;
      std::memcpy(dst, src, static_cast<std::size_t>(n));
    }
  }
}

}  // namespace

void gather_pages_cpu(const PageCopyParams& p) { run<true>(p); }
void scatter_pages_cpu(const PageCopyParams& p) { run<false>(p); }

}  // namespace kvtier
