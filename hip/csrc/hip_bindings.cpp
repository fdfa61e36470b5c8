// pybind11 module kvtier._hip: the GPU kernels of hip/kernels/ (built for AMD with HIP, or for
// NVIDIA with nvcc through kvtier/compat.h). Launches go on the stream handle passed in (the
// caller's current torch stream); no torch headers here or in the kernels.
#include <pybind11/pybind11.h>

#include "kernel_bindings.h"
#include "kvtier/mla_decode.h"

namespace {

struct GpuKernels {
  static void gather_pages(const kvtier::PageCopyParams& p, void* s) { kvtier::launch_gather_pages(p, s); }
  static void scatter_pages(const kvtier::PageCopyParams& p, void* s) { kvtier::launch_scatter_pages(p, s); }
  static void moe_align_block_size(const kvtier::MoeAlignParams& p, void* s) {
    kvtier::launch_moe_align_block_size(p, s);
  }
  static void mla_decode(const kvtier::MlaDecodeParams& p, void* s) { kvtier::launch_mla_decode(p, s); }
};

}  // namespace

PYBIND11_MODULE(_hip, m) {
  m.doc() = "kvtier GPU kernels (HIP sources; CUDA through kvtier/compat.h): page copy, paged MLA decode, "
            "moe_align_block_size";
  m.attr("PLATFORM") = KVTIER_HIP_PLATFORM;  // "hip" or "cuda", set by CMake
  m.attr("MLA_HEADS_PER_BLOCK") = kvtier::mla_decode_heads_per_block();
  kvtier::bind_kernels<GpuKernels>(m);
}
