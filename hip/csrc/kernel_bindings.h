// pybind11 bindings of the kernels, written once for two entry points with identical Python
// signatures: the GPU launchers (module kvtier._hip) and the CPU implementations (kvtier._C's
// submodule kernels_cpu). Arguments are raw addresses (tensor.data_ptr()), sizes and strides
// in elements, and a stream handle (ignored on CPU); kvtier.ops._native builds them from tensors.
// The GIL is released while a kernel is launched or a CPU implementation runs.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "kvtier/mla_decode.h"
#include "kvtier/moe_align.h"
#include "kvtier/pages.h"

namespace kvtier {

namespace py = pybind11;

// Entry points of the CPU implementations (the stream argument is ignored).
struct CpuKernels {
  static void gather_pages(const PageCopyParams& p, void*) { gather_pages_cpu(p); }
  static void scatter_pages(const PageCopyParams& p, void*) { scatter_pages_cpu(p); }
  static void moe_align_block_size(const MoeAlignParams& p, void*) { moe_align_block_size_cpu(p); }
  static void mla_decode(const MlaDecodeParams& p, void*) { mla_decode_cpu(p); }
};

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

template <typename Kernels>
void bind_kernels(py::module_& m) {
  m.attr("MLA_MAX_DIM") = kMlaMaxDim;
  m.attr("MLA_MAX_RANK") = kMlaMaxRank;
  m.attr("MLA_MAX_SPLITS") = kMlaMaxSplits;
  m.attr("MOE_ALIGN_MAX_EXPERTS") = kMoeAlignMaxExperts;

  auto page_copy = [](bool gather) {
    return [gather](std::uintptr_t layer_ptrs, const std::vector<std::uint64_t>& host_layer_ptrs, std::uintptr_t pages,
                    bool pages_int64, std::uintptr_t staging, std::int64_t num_blocks, std::int64_t num_pages,
                    std::int64_t page_bytes, std::int64_t page_stride_bytes, std::uintptr_t stream) {
      PageCopyParams p;
      p.layer_ptrs = as_ptr<const std::uint64_t>(layer_ptrs);
      p.pages = as_ptr<const void>(pages);
      p.pages_int64 = pages_int64;
      p.staging = as_ptr<void>(staging);
      p.num_blocks = num_blocks;
      p.num_layers = static_cast<std::int64_t>(host_layer_ptrs.size());
      p.num_pages = num_pages;
      p.page_bytes = page_bytes;
      p.page_stride_bytes = page_stride_bytes;
      p.word_bytes = page_copy_word_bytes(host_layer_ptrs.data(), p.num_layers, p.staging, page_bytes, page_stride_bytes);
      py::gil_scoped_release release;
      if (gather) {
        Kernels::gather_pages(p, as_ptr<void>(stream));
      } else {
        Kernels::scatter_pages(p, as_ptr<void>(stream));
      }
      return p.word_bytes;
    };
  };
  const char* page_doc =
      "Page copy between the pools at host_layer_ptrs (their addresses also in the int64 array at layer_ptrs, "
      "readable where the copy runs) and the page-first staging buffer; returns the word size used (bytes).";
  for (bool gather : {true, false}) {
    m.def(gather ? "gather_pages" : "scatter_pages", page_copy(gather), page_doc, py::arg("layer_ptrs"),
          py::arg("host_layer_ptrs"), py::arg("pages"), py::arg("pages_int64"), py::arg("staging"),
          py::arg("num_blocks"), py::arg("num_pages"), py::arg("page_bytes"), py::arg("page_stride_bytes"),
          py::arg("stream") = 0);
  }

  m.def("moe_align_workspace_size", &moe_align_workspace_size, py::arg("num_pairs"), py::arg("num_experts"),
        "int32 elements of the chunk_counts workspace");
  m.def(
      "moe_align_block_size",
      [](std::uintptr_t topk_ids, std::int64_t num_pairs, std::int32_t num_experts, std::int32_t block_m,
         std::uintptr_t sorted_ids, std::uintptr_t expert_ids, std::uintptr_t num_padded, std::uintptr_t chunk_counts,
         std::uintptr_t stream) {
        MoeAlignParams p;
        p.topk_ids = as_ptr<const std::int32_t>(topk_ids);
        p.num_pairs = num_pairs;
        p.num_experts = num_experts;
        p.block_m = block_m;
        p.sorted_ids = as_ptr<std::int32_t>(sorted_ids);
        p.expert_ids = as_ptr<std::int32_t>(expert_ids);
        p.num_padded = as_ptr<std::int32_t>(num_padded);
        p.chunk_counts = as_ptr<std::int32_t>(chunk_counts);
        py::gil_scoped_release release;
        Kernels::moe_align_block_size(p, as_ptr<void>(stream));
      },
      "Sort (token, choice) pairs by expert, padded per expert to block_m (see kvtier/moe_align.h).",
      py::arg("topk_ids"), py::arg("num_pairs"), py::arg("num_experts"), py::arg("block_m"), py::arg("sorted_ids"),
      py::arg("expert_ids"), py::arg("num_padded"), py::arg("chunk_counts"), py::arg("stream") = 0);

  m.def(
      "mla_decode",
      [](std::uintptr_t q, std::uintptr_t kv_cache, std::uintptr_t block_table, std::uintptr_t seq_lens,
         std::uintptr_t out, std::uintptr_t lse, std::uintptr_t part_out, std::uintptr_t part_lse,
         const std::vector<std::int64_t>& q_strides, const std::vector<std::int64_t>& kv_strides,
         std::int64_t block_table_stride, const std::vector<std::int64_t>& out_strides,
         const std::vector<std::int32_t>& sizes, float sm_scale, float kv_scale, int q_dtype, int kv_dtype,
         std::uintptr_t stream) {
        if (q_strides.size() != 2 || kv_strides.size() != 2 || out_strides.size() != 2 || sizes.size() != 8)
          throw py::value_error("q_strides, kv_strides, out_strides must have 2 entries and sizes 8 "
                                "(batch, num_heads, dim, kv_lora_rank, page_size, max_pages, num_pages, num_splits)");
        MlaDecodeParams p;
        p.q = as_ptr<const void>(q);
        p.kv_cache = as_ptr<const void>(kv_cache);
        p.block_table = as_ptr<const std::int32_t>(block_table);
        p.seq_lens = as_ptr<const std::int32_t>(seq_lens);
        p.out = as_ptr<void>(out);
        p.lse = as_ptr<float>(lse);
        p.part_out = as_ptr<float>(part_out);
        p.part_lse = as_ptr<float>(part_lse);
        p.q_stride_b = q_strides[0];
        p.q_stride_h = q_strides[1];
        p.kv_stride_page = kv_strides[0];
        p.kv_stride_slot = kv_strides[1];
        p.block_table_stride_b = block_table_stride;
        p.out_stride_b = out_strides[0];
        p.out_stride_h = out_strides[1];
        p.batch = sizes[0];
        p.num_heads = sizes[1];
        p.dim = sizes[2];
        p.kv_lora_rank = sizes[3];
        p.page_size = sizes[4];
        p.max_pages = sizes[5];
        p.num_pages = sizes[6];
        p.num_splits = sizes[7];
        p.sm_scale = sm_scale;
        p.kv_scale = kv_scale;
        p.q_dtype = static_cast<DType>(q_dtype);
        p.kv_dtype = static_cast<DType>(kv_dtype);
        py::gil_scoped_release release;
        Kernels::mla_decode(p, as_ptr<void>(stream));
      },
      "Split-KV paged MLA decode into out/lse via the fp32 workspace part_out/part_lse (see kvtier/mla_decode.h). "
      "Strides in elements: q (batch, head), kv (page, slot), out (batch, head); inner strides must be 1.",
      py::arg("q"), py::arg("kv_cache"), py::arg("block_table"), py::arg("seq_lens"), py::arg("out"), py::arg("lse"),
      py::arg("part_out"), py::arg("part_lse"), py::arg("q_strides"), py::arg("kv_strides"),
      py::arg("block_table_stride"), py::arg("out_strides"), py::arg("sizes"), py::arg("sm_scale"),
      py::arg("kv_scale"), py::arg("q_dtype"), py::arg("kv_dtype"), py::arg("stream") = 0);
}

}  // namespace kvtier
