// pybind11 bindings of the host runtime: the module kvtier._C.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "block_hash.h"

namespace py = pybind11;

namespace {

kvtier::BlockHash parse_parent(const py::object& parent) {
  if (parent.is_none()) return kvtier::block_hash_root();
  if (!py::isinstance<py::bytes>(parent)) throw py::type_error("parent must be bytes of length 16 or None");
  std::string s = parent.cast<std::string>();
  if (s.size() != kvtier::kBlockHashBytes)
    throw py::value_error("parent must be bytes of length 16, got length " + std::to_string(s.size()));
  kvtier::BlockHash h;
  std::memcpy(h.data(), s.data(), kvtier::kBlockHashBytes);
  return h;
}

py::list block_hashes(py::array_t<std::int64_t, py::array::c_style | py::array::forcecast> token_ids,
                      long long page_size, const py::object& parent, const py::bytes& salt) {
  if (token_ids.ndim() != 1)
    throw py::value_error("token_ids must be 1-D, got " + std::to_string(token_ids.ndim()) + " dims");
  if (page_size <= 0) throw py::value_error("page_size must be > 0, got " + std::to_string(page_size));
  const std::int64_t* data = token_ids.data();
  const std::size_t n = static_cast<std::size_t>(token_ids.shape(0));
  for (std::size_t i = 0; i < n; ++i) {
    if (data[i] < 0 || data[i] > 0xFFFFFFFFLL)
      throw py::value_error("token_ids[" + std::to_string(i) + "] must be in [0, 2**32), got " +
                            std::to_string(data[i]));
  }
  const kvtier::BlockHash root = parse_parent(parent);
  const std::string salt_s = salt;
  std::vector<kvtier::BlockHash> hashes;
  {
    py::gil_scoped_release release;
    hashes = kvtier::block_hashes(data, n, static_cast<std::size_t>(page_size), root,
                                  reinterpret_cast<const std::uint8_t*>(salt_s.data()), salt_s.size());
  }
  py::list out;
  for (const auto& h : hashes) out.append(py::bytes(reinterpret_cast<const char*>(h.data()), h.size()));
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvtier host runtime (block hash; later prefix index, copy engine, disk tier)";
  m.attr("BLOCK_HASH_BYTES") = py::int_(kvtier::kBlockHashBytes);
  m.def("block_hashes", &block_hashes, py::arg("token_ids"), py::arg("page_size"),
        py::arg("parent") = py::none(), py::arg("salt") = py::bytes(""),
        R"doc(Chained 128-bit hashes of every full block of ``token_ids``.

Args:
    token_ids: [num_tokens] integer token ids (any int dtype or a list), each in [0, 2**32).
    page_size: tokens per block (> 0). A trailing partial block is not hashed.
    parent: 16-byte hash of the block before ``token_ids[0]``; None for the start of a sequence.
    salt: tenant salt; different salts never share a chain.

Returns:
    list of ``num_tokens // page_size`` 16-byte ``bytes``.

Raises:
    ValueError: a token id out of range, page_size <= 0, token_ids not 1-D, parent of wrong length.
)doc");
}
