// pybind11 bindings of the host runtime: the module kvtier._C.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "block_hash.h"
#include "copy_engine.h"
#include "disk_tier.h"
#include "prefix_index.h"
#include "token_buffer.h"

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
      .def("insert_many", [](PrefixIndex& s, const py::sequence& hashes, int tier,
                             py::array_t<std::int64_t, py::array::c_style | py::array::forcecast> slots) {
        auto keys = to_hashes(hashes);
        if (slots.ndim() != 1 || static_cast<std::size_t>(slots.shape(0)) != keys.size())
          throw py::value_error("slots must be 1-D with one slot per hash (" + std::to_string(keys.size()) + ")");
        py::array_t<bool> out(static_cast<py::ssize_t>(keys.size()));
        bool* inserted = out.mutable_data();
        const std::int64_t* sl = slots.data();
        {
          py::gil_scoped_release r;
          s.insert_many(keys.data(), sl, keys.size(), tier, inserted);
        }
        return out;
      }, py::arg("hashes"), py::arg("tier"), py::arg("slots"))
      .def("remove_many", [](PrefixIndex& s, const py::sequence& hashes, int tier) {
        auto keys = to_hashes(hashes);
        std::vector<kvtier::RemoveResult> res(keys.size());
        py::array_t<std::int64_t> slots(static_cast<py::ssize_t>(keys.size()));
        std::int64_t* sl = slots.mutable_data();
        {
          py::gil_scoped_release r;
          s.remove_many(keys.data(), keys.size(), tier, res.data(), sl);
        }
        py::array_t<std::int8_t> results(static_cast<py::ssize_t>(keys.size()));
        auto w = results.mutable_unchecked<1>();
        for (std::size_t i = 0; i < keys.size(); ++i) w(i) = static_cast<std::int8_t>(res[i]);
        return py::make_tuple(results, slots);
      }, py::arg("hashes"), py::arg("tier"))
      .def("held_in", [](const PrefixIndex& s, const py::sequence& hashes, int tier) {
        auto keys = to_hashes(hashes);
        py::array_t<bool> out(static_cast<py::ssize_t>(keys.size()));
        bool* held = out.mutable_data();
        {
          py::gil_scoped_release r;
          s.held_in(keys.data(), keys.size(), tier, held);
        }
        return out;
      }, py::arg("hashes"), py::arg("tier"))
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
      .def("touch", [](PrefixIndex& s, const py::sequence& hashes, std::uint32_t tier_mask) {
        auto keys = to_hashes(hashes);
        py::gil_scoped_release r;
        s.touch(keys.data(), keys.size(), tier_mask);
      }, py::arg("hashes"), py::arg("tier_mask") = 0xFu)
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

// ---- Token buffer -------------------------------------------------------------------------
// The Python object owns the C++ buffer, a mutex that serialises calls (appends run without
// the GIL) and the count of live buffer-protocol exports (numpy / memoryview views of the ids).
// While a view exists the id storage must not move: an append that would reallocate raises
// BufferError (truncate and appends within capacity() are allowed; views see their effect).
struct PyTokenBuffer {
  PyTokenBuffer(long long page_size, const std::string& salt)
      : buf(check_page_size(page_size), reinterpret_cast<const std::uint8_t*>(salt.data()), salt.size()) {}
  static std::size_t check_page_size(long long page_size) {
    if (page_size <= 0) throw py::value_error("page_size must be > 0, got " + std::to_string(page_size));
    return static_cast<std::size_t>(page_size);
  }
  kvtier::TokenBuffer buf;
  std::mutex mu;
  std::size_t exports = 0;  // guarded by mu
};

// Appends above this many ids run without the GIL.
constexpr std::size_t kTokenBufferReleaseGil = 1024;

// Appends ids[0:n] of type T (int64 or uint64, range-checked) or uint32 (unchecked).
template <typename T>
void token_buffer_append(PyTokenBuffer& self, const T* ids, std::size_t n) {
  auto work = [&] {
    std::vector<std::uint32_t> narrow;
    const std::uint32_t* src = nullptr;
    if constexpr (std::is_same_v<T, std::uint32_t>) {
      src = ids;
    } else {
      narrow.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        const T t = ids[i];
        if (t < 0 || static_cast<std::uint64_t>(t) > 0xFFFFFFFFull)
          throw py::value_error("ids[" + std::to_string(i) + "] must be in [0, 2**32), got " + std::to_string(t));
        narrow[i] = static_cast<std::uint32_t>(t);
      }
      src = narrow.data();
    }
    std::lock_guard<std::mutex> lock(self.mu);
    const std::size_t need = self.buf.size() + n;
    if (self.exports > 0 && need > self.buf.capacity())
      throw py::buffer_error("TokenBuffer.append: " + std::to_string(n) + " ids need capacity " +
                             std::to_string(need) + " > " + std::to_string(self.buf.capacity()) +
                             " and the storage cannot move while " + std::to_string(self.exports) +
                             " view(s) of the ids exist; drop the views or reserve() first");
    self.buf.append(src, n);
  };
  if (n >= kTokenBufferReleaseGil) {
    py::gil_scoped_release release;
    work();
  } else {
    work();
  }
}

// A list or tuple of Python ints, read item by item (numpy.asarray on a list costs ~5x more).
// Raises TypeError on a bool. Returns false, having appended nothing, when an item is not an
// int in [0, 2**32): the general path below then converts or reports it.
bool token_buffer_append_ints(PyTokenBuffer& self, PyObject* seq) {
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<std::uint32_t> narrow(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = items[i];
    if (PyBool_Check(t)) throw py::type_error("ids[" + std::to_string(i) + "] must be an integer token id, got bool");
    if (!PyLong_CheckExact(t)) return false;  // numpy scalars, int subclasses, others
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(t, &overflow);
    if (overflow != 0 || v < 0 || v > 0xFFFFFFFFLL) return false;
    narrow[static_cast<std::size_t>(i)] = static_cast<std::uint32_t>(v);
  }
  if (n > 0) token_buffer_append(self, narrow.data(), narrow.size());
  return true;
}

void token_buffer_append_obj(PyTokenBuffer& self, const py::object& ids) {
  if ((PyList_CheckExact(ids.ptr()) || PyTuple_CheckExact(ids.ptr())) && token_buffer_append_ints(self, ids.ptr()))
    return;
  py::module_ np = py::module_::import("numpy");
  py::array arr;
  try {
    arr = np.attr("asarray")(ids);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_OverflowError)) throw;
    arr = py::array();  // an int outside int64/uint64: found below
  }
  if (!arr || arr.dtype().kind() == 'O') {
    // A sequence holding a Python int numpy could not store (or a non-integer object).
    py::sequence seq = py::reinterpret_borrow<py::sequence>(ids);
    for (std::size_t i = 0; i < seq.size(); ++i) {
      py::object t = seq[i];
      if (!PyLong_Check(t.ptr()))
        throw py::type_error("ids[" + std::to_string(i) + "] must be an int, got " +
                             std::string(py::str(py::type::of(t).attr("__name__"))));
      if (PyObject_RichCompareBool(t.ptr(), py::int_(0).ptr(), Py_LT) == 1 ||
          PyObject_RichCompareBool(t.ptr(), py::int_(0xFFFFFFFFull).ptr(), Py_GT) == 1)
        throw py::value_error("ids[" + std::to_string(i) + "] must be in [0, 2**32), got " +
                              std::string(py::str(t)));
    }
    throw py::type_error("ids must be a sequence of ints or a 1-D integer array");
  }
  if (arr.ndim() != 1) throw py::value_error("ids must be 1-D, got " + std::to_string(arr.ndim()) + " dims");
  const std::size_t n = static_cast<std::size_t>(arr.shape(0));
  if (n == 0) return;  // also covers [] (numpy makes it float64)
  const char kind = arr.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error("ids must be integers, got dtype " + std::string(py::str(arr.dtype())));
  if (kind == 'u' && arr.dtype().itemsize() == 4 && (arr.flags() & py::array::c_style)) {
    token_buffer_append(self, static_cast<const std::uint32_t*>(arr.data()), n);
  } else if (kind == 'u') {
    auto wide = py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    token_buffer_append(self, wide.data(), n);
  } else {
    auto wide = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    token_buffer_append(self, wide.data(), n);
  }
}

// Buffer protocol: a read-only 1-D view of the ids, format "I" (uint32), no copy.
extern "C" int token_buffer_getbuffer(PyObject* obj, Py_buffer* view, int flags) {
  view->obj = nullptr;
  if ((flags & PyBUF_WRITABLE) == PyBUF_WRITABLE) {
    PyErr_SetString(PyExc_BufferError, "TokenBuffer ids are read-only");
    return -1;
  }
  PyTokenBuffer* self = nullptr;
  try {
    self = py::handle(obj).cast<PyTokenBuffer*>();
  } catch (...) {
    PyErr_SetString(PyExc_BufferError, "TokenBuffer: not initialised");
    return -1;
  }
  static const std::uint32_t kEmpty = 0;
  std::lock_guard<std::mutex> lock(self->mu);
  auto* shape_strides = new Py_ssize_t[2]{static_cast<Py_ssize_t>(self->buf.size()), 4};
  const std::uint32_t* data = self->buf.size() > 0 ? self->buf.ids() : &kEmpty;
  view->buf = const_cast<std::uint32_t*>(data);
  view->obj = obj;
  Py_INCREF(obj);
  view->len = static_cast<Py_ssize_t>(self->buf.size() * sizeof(std::uint32_t));
  view->itemsize = sizeof(std::uint32_t);
  view->readonly = 1;
  view->ndim = 1;
  view->format = (flags & PyBUF_FORMAT) ? const_cast<char*>("I") : nullptr;
  view->shape = (flags & PyBUF_ND) == PyBUF_ND ? shape_strides : nullptr;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? shape_strides + 1 : nullptr;
  view->suboffsets = nullptr;
  view->internal = shape_strides;
  ++self->exports;
  return 0;
}

extern "C" void token_buffer_releasebuffer(PyObject* obj, Py_buffer* view) {
  delete[] static_cast<Py_ssize_t*>(view->internal);
  PyTokenBuffer* self = py::handle(obj).cast<PyTokenBuffer*>();
  std::lock_guard<std::mutex> lock(self->mu);
  --self->exports;
}

void bind_token_buffer(py::module_& m) {
  py::class_<PyTokenBuffer> cls(m, "TokenBuffer", py::buffer_protocol(),
                                "Native token buffer; see kvtier.tokenize.buffer.TokenBuffer for the contract.");
  auto* heap_type = reinterpret_cast<PyHeapTypeObject*>(cls.ptr());
  heap_type->as_buffer.bf_getbuffer = token_buffer_getbuffer;
  heap_type->as_buffer.bf_releasebuffer = token_buffer_releasebuffer;
  cls.def(py::init([](long long page_size, const py::bytes& salt) {
            return std::make_unique<PyTokenBuffer>(page_size, std::string(salt));
          }),
          py::arg("page_size"), py::arg("salt") = py::bytes(""))
      .def("append", &token_buffer_append_obj, py::arg("ids"))
      .def("truncate", [](PyTokenBuffer& self, long long n) {
        std::lock_guard<std::mutex> lock(self.mu);
        if (n < 0 || static_cast<std::size_t>(n) > self.buf.size())
          throw py::value_error("truncate: n must be in [0, " + std::to_string(self.buf.size()) + "], got " +
                                std::to_string(n));
        self.buf.truncate(static_cast<std::size_t>(n));
      }, py::arg("n"))
      .def("reserve", [](PyTokenBuffer& self, long long capacity) {
        std::lock_guard<std::mutex> lock(self.mu);
        if (capacity < 0) throw py::value_error("capacity must be >= 0, got " + std::to_string(capacity));
        if (self.exports > 0 && static_cast<std::size_t>(capacity) > self.buf.capacity())
          throw py::buffer_error("TokenBuffer.reserve: the storage cannot move while views of the ids exist");
        self.buf.reserve(static_cast<std::size_t>(capacity));
      }, py::arg("capacity"))
      .def("__len__", [](PyTokenBuffer& self) {
        std::lock_guard<std::mutex> lock(self.mu);
        return self.buf.size();
      })
      .def_property_readonly("ids", [](py::object self) { return py::array(py::memoryview(self)); })
      .def("block_hashes", [](PyTokenBuffer& self, long long start) {
        std::lock_guard<std::mutex> lock(self.mu);
        const auto& hashes = self.buf.hashes();
        if (start < 0 || static_cast<std::size_t>(start) > hashes.size())
          throw py::value_error("block_hashes: start must be in [0, " + std::to_string(hashes.size()) + "], got " +
                                std::to_string(start));
        py::list out;
        for (std::size_t i = static_cast<std::size_t>(start); i < hashes.size(); ++i) out.append(from_hash(hashes[i]));
        return out;
      }, py::arg("start") = 0)
      .def_property_readonly("last_hash", [](PyTokenBuffer& self) {
        std::lock_guard<std::mutex> lock(self.mu);
        return from_hash(self.buf.last_hash());
      })
      .def_property_readonly("num_blocks", [](PyTokenBuffer& self) {
        std::lock_guard<std::mutex> lock(self.mu);
        return self.buf.num_blocks();
      })
      .def_property_readonly("capacity", [](PyTokenBuffer& self) {
        std::lock_guard<std::mutex> lock(self.mu);
        return self.buf.capacity();
      })
      .def_property_readonly("page_size", [](PyTokenBuffer& self) { return self.buf.page_size(); })
      .def_property_readonly("salt", [](PyTokenBuffer& self) {
        const auto& s = self.buf.salt();
        return py::bytes(reinterpret_cast<const char*>(s.data()), s.size());
      })
      .def_property_readonly("num_views", [](PyTokenBuffer& self) {
        std::lock_guard<std::mutex> lock(self.mu);
        return self.exports;
      });
}

}  // namespace

void bind_kernels_cpu(py::module_& parent);  // kernels_cpu_bindings.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvtier host runtime: block hash, prefix index, copy engine, disk tier, token buffer; kernels_cpu";
  bind_kernels_cpu(m);
  bind_prefix_index(m);
  bind_disk_tier(m);
  bind_copy_engine(m);
  bind_token_buffer(m);
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
