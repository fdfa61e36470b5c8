// pybind11 bindings of the host runtime: the module kvtier._C.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <tuple>

#include "block_hash.h"
#include "copy_engine.h"
#include "disk_tier.h"
#include "prefix_index.h"

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

kvtier::BlockHash to_hash(const py::handle& obj, std::size_t i) {
  char* data = nullptr;
  Py_ssize_t len = 0;
  if (!PyBytes_Check(obj.ptr()) || PyBytes_AsStringAndSize(obj.ptr(), &data, &len) != 0 ||
      len != static_cast<Py_ssize_t>(kvtier::kBlockHashBytes))
    throw py::value_error("hashes[" + std::to_string(i) + "] must be bytes of length 16");
  kvtier::BlockHash h;
  std::memcpy(h.data(), data, kvtier::kBlockHashBytes);
  return h;
}

std::vector<kvtier::BlockHash> to_hashes(const py::sequence& seq) {
  std::vector<kvtier::BlockHash> out;
  out.reserve(seq.size());
  for (std::size_t i = 0; i < seq.size(); ++i) out.push_back(to_hash(seq[i], i));
  return out;
}

py::bytes from_hash(const kvtier::BlockHash& h) {
  return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
}

void bind_prefix_index(py::module_& m) {
  using kvtier::PrefixIndex;
  m.attr("NUM_TIERS") = py::int_(kvtier::kNumTiers);
  py::class_<PrefixIndex>(m, "PrefixIndex", "Native prefix index; see kvtier.cache.prefix_index for the contract.")
      .def(py::init<std::size_t>(), py::arg("max_events") = 1 << 16)
      .def("insert", [](PrefixIndex& s, const py::bytes& h, int tier, std::int64_t slot) {
        auto key = to_hash(h, 0);
        py::gil_scoped_release r;
        return s.insert(key, tier, slot);
      }, py::arg("hash"), py::arg("tier"), py::arg("slot"))
      .def("remove", [](PrefixIndex& s, const py::bytes& h, int tier) {
        auto key = to_hash(h, 0);
        std::int64_t slot = -1;
        kvtier::RemoveResult res;
        {
          py::gil_scoped_release r;
          res = s.remove(key, tier, &slot);
        }
        return py::make_tuple(static_cast<int>(res), slot);
      }, py::arg("hash"), py::arg("tier"))
      .def("match", [](const PrefixIndex& s, const py::sequence& hashes, std::uint32_t tier_mask) {
        auto keys = to_hashes(hashes);
        std::vector<kvtier::Slots> slots(keys.size());
        std::size_t m;
        {
          py::gil_scoped_release r;
          m = s.match(keys.data(), keys.size(), tier_mask, slots.data());
        }
        py::array_t<std::int64_t> out({static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(kvtier::kNumTiers)});
        auto w = out.mutable_unchecked<2>();
        for (std::size_t i = 0; i < m; ++i)
          for (int t = 0; t < kvtier::kNumTiers; ++t) w(i, t) = slots[i][t];
        return out;
      }, py::arg("hashes"), py::arg("tier_mask") = 0xFu)
      .def("touch", [](PrefixIndex& s, const py::sequence& hashes) {
        auto keys = to_hashes(hashes);
        py::gil_scoped_release r;
        s.touch(keys.data(), keys.size());
      }, py::arg("hashes"))
      .def("lock", [](PrefixIndex& s, const py::sequence& hashes, int tier) {
        auto keys = to_hashes(hashes);
        py::gil_scoped_release r;
        return s.lock(keys.data(), keys.size(), tier);
      }, py::arg("hashes"), py::arg("tier"))
      .def("unlock", [](PrefixIndex& s, const py::sequence& hashes, int tier) {
        auto keys = to_hashes(hashes);
        py::gil_scoped_release r;
        return s.unlock(keys.data(), keys.size(), tier);
      }, py::arg("hashes"), py::arg("tier"))
      .def("eviction_candidates", [](const PrefixIndex& s, int tier, std::size_t max_n) {
        std::vector<std::pair<kvtier::BlockHash, std::int64_t>> c;
        {
          py::gil_scoped_release r;
          c = s.eviction_candidates(tier, max_n);
        }
        py::list out;
        for (auto& [h, slot] : c) out.append(py::make_tuple(from_hash(h), slot));
        return out;
      }, py::arg("tier"), py::arg("max_n"))
      .def("drain_events", [](PrefixIndex& s, std::size_t max_n) {
        auto ev = s.drain_events(max_n);
        py::list out;
        for (auto& e : ev) out.append(py::make_tuple(static_cast<int>(e.kind), e.tier, from_hash(e.hash), e.slot));
        return out;
      }, py::arg("max_n") = static_cast<std::size_t>(-1))
      .def("dropped_events", &PrefixIndex::dropped_events)
      .def("num_blocks", &PrefixIndex::num_blocks)
      .def("num_copies", &PrefixIndex::num_copies, py::arg("tier"))
      .def("ref_count", [](const PrefixIndex& s, const py::bytes& h, int tier) {
        return s.ref_count(to_hash(h, 0), tier);
      }, py::arg("hash"), py::arg("tier"))
      .def("check_invariants", &PrefixIndex::check_invariants);
}

kvtier::PagePools make_pools(const std::vector<std::uintptr_t>& layer_ptrs, std::int64_t page_stride_bytes,
                            std::int64_t page_bytes, std::int64_t num_pages) {
  if (page_bytes <= 0 || page_stride_bytes < page_bytes || num_pages <= 0)
    throw py::value_error("page pools need page_bytes > 0, page_stride_bytes >= page_bytes and num_pages > 0");
  kvtier::PagePools pools;
  for (auto p : layer_ptrs) pools.layer_base.push_back(reinterpret_cast<std::uint8_t*>(p));
  pools.page_stride_bytes = page_stride_bytes;
  pools.page_bytes = page_bytes;
  pools.num_pages = num_pages;
  return pools;
}

std::vector<std::int64_t> to_pages(const py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>& a) {
  if (a.ndim() != 1) throw py::value_error("pages must be 1-D");
  return std::vector<std::int64_t>(a.data(), a.data() + a.shape(0));
}

using MetaTuple = std::tuple<std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t, std::uint64_t>;

kvtier::BlockMeta to_meta(const MetaTuple& t) {
  kvtier::BlockMeta m;
  std::tie(m.num_layers, m.page_size, m.row_bytes, m.dtype, m.payload_bytes) = t;
  return m;
}

MetaTuple from_meta(const kvtier::BlockMeta& m) {
  return {m.num_layers, m.page_size, m.row_bytes, m.dtype, m.payload_bytes};
}

py::list blocks_list(const std::vector<std::pair<kvtier::BlockHash, kvtier::BlockMeta>>& blocks) {
  py::list out;
  for (auto& [h, meta] : blocks) out.append(py::make_tuple(from_hash(h), from_meta(meta)));
  return out;
}

void bind_disk_tier(py::module_& m) {
  using kvtier::DiskTier;
  py::class_<DiskTier, std::shared_ptr<DiskTier>>(m, "DiskTier", "Native disk tier; see kvtier.cache.disk_tier.")
      .def(py::init<std::string, std::uint64_t, bool>(), py::arg("dir"), py::arg("capacity_bytes"),
           py::arg("try_direct_io") = true, py::call_guard<py::gil_scoped_release>())
      .def("write", [](DiskTier& d, const py::bytes& h, const MetaTuple& meta, std::uintptr_t ptr) {
        auto key = to_hash(h, 0);
        py::gil_scoped_release r;
        return static_cast<int>(d.write(key, to_meta(meta), reinterpret_cast<const void*>(ptr)));
      }, py::arg("hash"), py::arg("meta"), py::arg("payload_ptr"))
      .def("read", [](DiskTier& d, const py::bytes& h, const MetaTuple& meta, std::uintptr_t ptr, std::uint64_t n) {
        auto key = to_hash(h, 0);
        py::gil_scoped_release r;
        return static_cast<int>(d.read(key, to_meta(meta), reinterpret_cast<void*>(ptr), n));
      }, py::arg("hash"), py::arg("meta"), py::arg("out_ptr"), py::arg("out_bytes"))
      .def("remove", [](DiskTier& d, const py::bytes& h) { return d.remove(to_hash(h, 0)); }, py::arg("hash"))
      .def("contains", [](const DiskTier& d, const py::bytes& h) { return d.contains(to_hash(h, 0)); },
           py::arg("hash"))
      .def("used_bytes", &DiskTier::used_bytes)
      .def("capacity_bytes", &DiskTier::capacity_bytes)
      .def("num_blocks", &DiskTier::num_blocks)
      .def("direct_io", &DiskTier::direct_io)
      .def("blocks", [](const DiskTier& d) { return blocks_list(d.blocks()); })
      .def("scan", [](DiskTier& d) {
        std::vector<std::pair<kvtier::BlockHash, kvtier::BlockMeta>> b;
        {
          py::gil_scoped_release r;
          b = d.scan();
        }
        return blocks_list(b);
      })
      .def("block_path", [](const DiskTier& d, const py::bytes& h) { return d.block_path(to_hash(h, 0)); },
           py::arg("hash"))
      .def_static("file_bytes_for", &DiskTier::file_bytes_for, py::arg("payload_bytes"));
  m.def("disk_status_name", [](int s) { return std::string(kvtier::to_string(static_cast<kvtier::DiskStatus>(s))); });
}

// A disk job over n blocks laid out back to back (block_bytes each) at ptr.
kvtier::CopyEngine::Job disk_job(std::shared_ptr<kvtier::DiskTier> disk, std::vector<kvtier::BlockHash> keys,
                         kvtier::BlockMeta meta, std::uint8_t* ptr, bool write) {
  return [disk, keys, meta, ptr, write] {
    std::vector<int> status;
    status.reserve(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      std::uint8_t* p = ptr + i * meta.payload_bytes;
      auto st = write ? disk->write(keys[i], meta, p) : disk->read(keys[i], meta, p, meta.payload_bytes);
      status.push_back(static_cast<int>(st));
    }
    return status;
  };
}

// A binding that queues a gather (pools -> staging) or scatter (staging -> pools) job.
auto submit_pages(bool gather) {
  return [gather](kvtier::CopyEngine& e, const std::vector<std::uintptr_t>& layer_ptrs, std::int64_t stride,
                  std::int64_t page_bytes, std::int64_t num_pages,
                  const py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>& pages,
                  std::uintptr_t staging, bool block) {
    auto pools = make_pools(layer_ptrs, stride, page_bytes, num_pages);
    auto pg = to_pages(pages);
    auto* buf = reinterpret_cast<std::uint8_t*>(staging);
    kvtier::CopyEngine::Job job = [pools, pg, buf, gather] {
      if (gather) {
        kvtier::gather_pages(pools, pg.data(), pg.size(), buf);
      } else {
        kvtier::scatter_pages(pools, pg.data(), pg.size(), buf);
      }
      return std::vector<int>(pg.size(), 0);
    };
    py::gil_scoped_release r;
    return block ? e.submit(std::move(job)) : e.try_submit(std::move(job));
  };
}

void bind_copy_engine(py::module_& m) {
  using kvtier::CopyEngine;
  py::enum_<kvtier::JobState>(m, "JobState")
      .value("PENDING", kvtier::JobState::kPending)
      .value("DONE", kvtier::JobState::kDone)
      .value("FAILED", kvtier::JobState::kFailed);
  py::class_<CopyEngine>(m, "CopyEngine", "Native copy engine; see kvtier.transfer for the contract.")
      .def(py::init<int, std::size_t>(), py::arg("num_threads"), py::arg("max_queued"))
      .def("submit_gather", submit_pages(true), "pools -> page-first staging", py::arg("layer_ptrs"),
           py::arg("page_stride_bytes"), py::arg("page_bytes"), py::arg("num_pages"), py::arg("pages"),
           py::arg("staging_ptr"), py::arg("block") = true)
      .def("submit_scatter", submit_pages(false), "page-first staging -> pools", py::arg("layer_ptrs"),
           py::arg("page_stride_bytes"), py::arg("page_bytes"), py::arg("num_pages"), py::arg("pages"),
           py::arg("staging_ptr"), py::arg("block") = true)
      .def("submit_disk", [](CopyEngine& e, std::shared_ptr<kvtier::DiskTier> disk, const py::sequence& hashes,
                             const MetaTuple& meta, std::uintptr_t ptr, bool write, bool block) {
        auto job = disk_job(std::move(disk), to_hashes(hashes), to_meta(meta), reinterpret_cast<std::uint8_t*>(ptr),
                            write);
        py::gil_scoped_release r;
        return block ? e.submit(std::move(job)) : e.try_submit(std::move(job));
      }, py::arg("disk"), py::arg("hashes"), py::arg("meta"), py::arg("ptr"), py::arg("write"),
         py::arg("block") = true)
      .def("poll", &CopyEngine::poll, py::arg("handle"))
      .def("wait", &CopyEngine::wait, py::arg("handle"), py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("collect", [](CopyEngine& e, CopyEngine::Handle h) {
        auto r = e.collect(h);
        return py::make_tuple(r.state, r.block_status, r.error, r.run_s);
      }, py::arg("handle"))
      .def("queued", &CopyEngine::queued)
      .def_property_readonly("num_threads", &CopyEngine::num_threads);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvtier host runtime: block hash, prefix index, copy engine, disk tier";
  bind_prefix_index(m);
  bind_disk_tier(m);
  bind_copy_engine(m);
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
