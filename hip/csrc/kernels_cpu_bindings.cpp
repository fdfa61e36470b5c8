// kvtier._C.kernels_cpu: the CPU implementations of the GPU kernels' semantics, with the same
// Python signatures as kvtier._hip (kernel_bindings.h), plus the element conversions they use.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernel_bindings.h"
#include "kvtier/numeric.h"

namespace {

template <typename F>
void visit_dtype(int code, F&& f) {
  switch (static_cast<kvtier::DType>(code)) {
    case kvtier::DType::kFloat32: return f(kvtier::F32{});
    case kvtier::DType::kFloat16: return f(kvtier::F16{});
    case kvtier::DType::kBFloat16: return f(kvtier::BF16{});
    case kvtier::DType::kFloat8E4M3FN: return f(kvtier::E4M3FN{});
    case kvtier::DType::kFloat8E4M3FNUZ: return f(kvtier::E4M3FNUZ{});
  }
  throw std::invalid_argument("dtype code must be in [0, 4], got " + std::to_string(code));
}

}  // namespace

void bind_kernels_cpu(pybind11::module_& parent) {
  namespace py = pybind11;
  auto m = parent.def_submodule("kernels_cpu", "CPU implementations of the kvtier._hip kernels (same signatures)");
  m.attr("PLATFORM") = "cpu";
  kvtier::bind_kernels<kvtier::CpuKernels>(m);
  m.def(
      "to_float32",
      [](int dtype, std::uintptr_t src, std::int64_t n, std::uintptr_t dst) {
        visit_dtype(dtype, [&](auto tag) {
          using T = decltype(tag);
          const auto* in = reinterpret_cast<const typename T::storage*>(src);
          auto* out = reinterpret_cast<float*>(dst);
          for (std::int64_t i = 0; i < n; ++i) out[i] = T::to_float(in[i]);
        });
      },
      "dst[i] = float(src[i]) for n elements of dtype code `dtype` (kvtier/numeric.h)", py::arg("dtype"),
      py::arg("src"), py::arg("n"), py::arg("dst"));
  m.def(
      "from_float32",
      [](int dtype, std::uintptr_t src, std::int64_t n, std::uintptr_t dst) {
        auto convert = [&](auto tag) {
          using T = decltype(tag);
          const auto* in = reinterpret_cast<const float*>(src);
          auto* out = reinterpret_cast<typename T::storage*>(dst);
          for (std::int64_t i = 0; i < n; ++i) out[i] = T::from_float(in[i]);
        };
        switch (static_cast<kvtier::DType>(dtype)) {
          case kvtier::DType::kFloat32: return convert(kvtier::F32{});
          case kvtier::DType::kFloat16: return convert(kvtier::F16{});
          case kvtier::DType::kBFloat16: return convert(kvtier::BF16{});
          default: throw std::invalid_argument("from_float32: dtype must be 0 (fp32), 1 (fp16) or 2 (bf16)");
        }
      },
      "dst[i] = src[i] rounded to dtype (nearest even) for the output dtypes fp32/fp16/bf16", py::arg("dtype"),
      py::arg("src"), py::arg("n"), py::arg("dst"));
}
