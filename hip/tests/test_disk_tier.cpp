// Host tests of the disk tier: round trips in both I/O modes, content addressing, capacity,
// every kind of corruption, restart (scan), a multi-threaded stress test, and a really full
// filesystem (a 1 MiB tmpfs, when this process may mount one).
#include <dirent.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "block_hash.h"
#include "check.h"
#include "disk_tier.h"

using kvtier::BlockHash;
using kvtier::BlockMeta;
using kvtier::DiskStatus;
using kvtier::DiskTier;

namespace {

// A fresh directory under /tmp, removed with everything in it at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/kvtier_disk_XXXXXX";
    CHECK(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string sub(const std::string& name) const { return path + "/" + name; }
};

BlockHash make_hash(std::int64_t i) {
  const std::int64_t token = i;
  return kvtier::block_hash_next(kvtier::block_hash_root(), &token, 1, nullptr, 0);
}

// Deterministic bytes that depend on the hash, so a mixed-up block is visible.
std::vector<std::uint8_t> make_payload(const BlockHash& h, std::uint64_t n) {
  std::vector<std::uint8_t> p(n);
  std::uint32_t x = 2166136261u;
  for (std::uint8_t b : h) x = (x ^ b) * 16777619u;
  for (std::uint64_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    p[i] = static_cast<std::uint8_t>(x);
  }
  return p;
}

BlockMeta make_meta(std::uint64_t payload_bytes) {
  BlockMeta m;
  m.num_layers = 61;
  m.page_size = 64;
  m.row_bytes = 656;
  m.dtype = 7;
  m.payload_bytes = payload_bytes;
  return m;
}

// A buffer of n bytes that starts `shift` bytes past a kDiskAlign boundary (0: O_DIRECT goes
// straight to it; else through the tier's bounce buffer), followed by 64 guard bytes.
struct Buffer {
  std::vector<std::uint8_t> storage;
  std::uint8_t* p;
  Buffer(std::uint64_t n, std::size_t shift, std::uint8_t fill) : storage(n + 64 + 2 * kvtier::kDiskAlign, fill) {
    const auto base = reinterpret_cast<std::uintptr_t>(storage.data());
    p = storage.data() + (kvtier::kDiskAlign - base % kvtier::kDiskAlign) + shift;
  }
};

DiskStatus put(DiskTier& t, const BlockHash& h, std::uint64_t n, std::size_t shift = 0) {
  const auto want = make_payload(h, n);
  Buffer b(n, shift, 0);
  std::copy(want.begin(), want.end(), b.p);
  return t.write(h, make_meta(n), b.p);
}

// kOk and bit-identical to make_payload(h, n); never touches bytes past the payload.
bool read_matches(DiskTier& t, const BlockHash& h, std::uint64_t n, DiskStatus* st_out = nullptr,
                  std::size_t shift = 0) {
  Buffer b(n, shift, 0xA5);
  const DiskStatus st = t.read(h, make_meta(n), b.p, n + 64);
  if (st_out != nullptr) *st_out = st;
  if (st != DiskStatus::kOk) return false;
  const auto want = make_payload(h, n);
  for (std::size_t i = n; i < n + 64; ++i) CHECK(b.p[i] == 0xA5);
  return std::equal(want.begin(), want.end(), b.p);
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::size_t count_suffix(const std::string& dir, const std::string& suffix) {
  std::size_t n = 0;
  for (const auto& name : list_dir(dir)) {
    if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) ++n;
  }
  return n;
}

// Mounts `fs` at `dir` for a test. CHECK exits without running destructors, so the mount and its
// directory are also undone at exit.
std::vector<std::string> g_mounts;
void unmount_all() {
  for (const auto& m : g_mounts) {
    ::umount2(m.c_str(), MNT_DETACH);
    std::filesystem::remove_all(m.substr(0, m.rfind('/')));
  }
  g_mounts.clear();
}
bool mount_fs(const char* fs, const std::string& dir, const char* options) {
  if (::mount(fs, dir.c_str(), fs, 0, options) != 0) return false;
  if (g_mounts.empty()) std::atexit(unmount_all);
  g_mounts.push_back(dir);
  return true;
}
void unmount(const std::string& dir) {
  CHECK(::umount2(dir.c_str(), MNT_DETACH) == 0);
  g_mounts.erase(std::find(g_mounts.begin(), g_mounts.end(), dir));
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

std::uint64_t file_size(const std::string& path) { return std::filesystem::file_size(path); }

void flip_byte(const std::string& path, std::uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  CHECK(f.good());
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
  CHECK(f.good());
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  CHECK(f.good());
}

// Sum of the on-disk sizes of what the tier lists == used_bytes(), and the directory holds
// exactly those block files and no temp file.
void check_consistent(DiskTier& t) {
  std::uint64_t sum = 0;
  std::set<std::string> want;
  for (const auto& hm : t.blocks()) {
    sum += DiskTier::file_bytes_for(hm.second.payload_bytes);
    const std::string path = t.block_path(hm.first);
    CHECK(file_size(path) == DiskTier::file_bytes_for(hm.second.payload_bytes));
    want.insert(path.substr(path.rfind('/') + 1));
  }
  CHECK(t.used_bytes() == sum);
  CHECK(t.num_blocks() == want.size());
  std::set<std::string> have;
  for (const auto& name : list_dir(t.dir())) {
    if (name.size() > 4 && name.substr(name.size() - 4) == ".kvb") have.insert(name);
  }
  CHECK(have == want);
  CHECK(count_suffix(t.dir(), ".tmp") == 0);
}

const std::uint64_t kSizes[] = {0, 1, 4096 - 64, 4096, 5000, 3 * 4096 + 17, 1 << 20, (1 << 20) + 12345};

void test_round_trip(bool try_direct) {
  TempDir dir;
  DiskTier t(dir.sub("tier"), std::uint64_t{1} << 30, try_direct);  // creates the sub-directory
  if (!try_direct) CHECK(!t.direct_io());
  CHECK(t.num_blocks() == 0 && t.used_bytes() == 0 && t.capacity_bytes() == (std::uint64_t{1} << 30));
  std::uint64_t used = 0;
  for (std::size_t i = 0; i < sizeof(kSizes) / sizeof(kSizes[0]); ++i) {
    const BlockHash h = make_hash(static_cast<std::int64_t>(i));
    CHECK(!t.contains(h));
    CHECK(put(t, h, kSizes[i]) == DiskStatus::kOk);
    CHECK(t.contains(h));
    used += DiskTier::file_bytes_for(kSizes[i]);
    CHECK(t.used_bytes() == used);
    CHECK(file_size(t.block_path(h)) % kvtier::kDiskAlign == 0);
  }
  // Aligned and unaligned caller buffers (straight O_DIRECT or the bounce buffer) read alike.
  for (std::size_t i = 0; i < sizeof(kSizes) / sizeof(kSizes[0]); ++i) {
    for (std::size_t shift : {0, 8, 100}) {
      DiskStatus st;
      CHECK(read_matches(t, make_hash(static_cast<std::int64_t>(i)), kSizes[i], &st, shift));
    }
  }
  // An unaligned source buffer writes the same file.
  for (std::size_t i = 0; i < sizeof(kSizes) / sizeof(kSizes[0]); ++i) {
    const BlockHash h = make_hash(static_cast<std::int64_t>(100 + i));
    CHECK(put(t, h, kSizes[i], 24) == DiskStatus::kOk);
    CHECK(read_matches(t, h, kSizes[i]));
    CHECK(t.remove(h));
  }
  // The header page, then the payload rounded up to whole pages.
  CHECK(DiskTier::file_bytes_for(0) == 4096 && DiskTier::file_bytes_for(1) == 8192 &&
        DiskTier::file_bytes_for(4096) == 8192 && DiskTier::file_bytes_for(4097) == 12288);
  // Too small an output buffer: refused before any I/O, block kept.
  const BlockHash h5 = make_hash(4);
  std::vector<std::uint8_t> small(4999);
  CHECK(t.read(h5, make_meta(5000), small.data(), small.size()) == DiskStatus::kBadArgument);
  CHECK(t.contains(h5));
  CHECK(t.write(make_hash(99), make_meta(10), nullptr) == DiskStatus::kBadArgument);
  // The file name is the lowercase hex of the hash.
  const std::string name = t.block_path(h5).substr(t.block_path(h5).rfind('/') + 1);
  char hex[3];
  std::snprintf(hex, sizeof(hex), "%02x", h5[0]);
  CHECK(name.size() == 36 && name.compare(0, 2, hex) == 0 && name.substr(32) == ".kvb");
  check_consistent(t);
  // The other I/O mode reads the same files (one on-disk format).
  DiskTier other(t.dir(), std::uint64_t{1} << 30, !try_direct);
  CHECK(other.num_blocks() == t.num_blocks() && other.used_bytes() == t.used_bytes());
  for (std::size_t i = 0; i < sizeof(kSizes) / sizeof(kSizes[0]); ++i) {
    CHECK(read_matches(other, make_hash(static_cast<std::int64_t>(i)), kSizes[i]));
  }
  // remove
  CHECK(t.remove(h5));
  CHECK(!t.remove(h5));
  CHECK(!t.contains(h5) && !exists(t.block_path(h5)));
  CHECK(t.read(h5, make_meta(5000), small.data(), 5000) == DiskStatus::kMissing);
  check_consistent(t);
}

void test_existing_hash() {
  TempDir dir;
  DiskTier t(dir.path, 1 << 20);
  const BlockHash h = make_hash(1);
  CHECK(put(t, h, 3000) == DiskStatus::kOk);
  const std::uint64_t used = t.used_bytes();
  // Same hash, other bytes and meta: kOk, nothing rewritten.
  const auto other = make_payload(make_hash(2), 9000);
  CHECK(t.write(h, make_meta(9000), other.data()) == DiskStatus::kOk);
  CHECK(t.used_bytes() == used && t.num_blocks() == 1);
  CHECK(read_matches(t, h, 3000));
  check_consistent(t);
}

void test_capacity() {
  TempDir dir;
  const std::uint64_t fb = DiskTier::file_bytes_for(5000);  // 12288
  DiskTier t(dir.path, 3 * fb + 100);
  for (int i = 0; i < 3; ++i) CHECK(put(t, make_hash(i), 5000) == DiskStatus::kOk);
  CHECK(put(t, make_hash(3), 5000) == DiskStatus::kFull);
  CHECK(put(t, make_hash(4), 1) == DiskStatus::kFull);  // 8192 bytes on disk, 100 left
  CHECK(!t.contains(make_hash(3)) && !exists(t.block_path(make_hash(3))));
  CHECK(put(t, make_hash(5), 4 * fb) == DiskStatus::kTooLarge);  // can never fit
  for (int i = 0; i < 3; ++i) CHECK(read_matches(t, make_hash(i), 5000));
  CHECK(t.used_bytes() == 3 * fb);
  check_consistent(t);
  CHECK(t.remove(make_hash(0)));
  CHECK(put(t, make_hash(3), 5000) == DiskStatus::kOk);
  CHECK(read_matches(t, make_hash(3), 5000));
  // Writing an existing hash at full capacity is still kOk.
  CHECK(put(t, make_hash(1), 5000) == DiskStatus::kOk);
  check_consistent(t);
}

// Stores block i, damages its file with `damage`, expects kCorrupt from read and the file gone.
template <typename Damage>
void expect_corrupt(DiskTier& t, std::int64_t i, std::uint64_t n, Damage damage) {
  const BlockHash h = make_hash(i);
  CHECK(put(t, h, n) == DiskStatus::kOk);
  const std::uint64_t used = t.used_bytes();
  damage(t.block_path(h));
  DiskStatus st;
  CHECK(!read_matches(t, h, n, &st));
  CHECK(st == DiskStatus::kCorrupt);
  CHECK(!exists(t.block_path(h)) && !t.contains(h));
  CHECK(t.used_bytes() == used - DiskTier::file_bytes_for(n));
  CHECK(!read_matches(t, h, n, &st) && st == DiskStatus::kMissing);
  check_consistent(t);
}

void test_corruption() {
  TempDir dir;
  DiskTier t(dir.path, std::uint64_t{1} << 30);
  CHECK(put(t, make_hash(1000), 777) == DiskStatus::kOk);  // a bystander that must survive
  std::int64_t i = 0;
  const std::uint64_t n = 3 * 4096 + 17;
  // Payload bytes: first, middle, first and last of the tail page.
  for (std::uint64_t off : {std::uint64_t{0}, n / 2, 3 * std::uint64_t{4096}, n - 1}) {
    expect_corrupt(t, i++, n, [&](const std::string& p) { flip_byte(p, kvtier::kDiskPayloadOffset + off); });
  }
  expect_corrupt(t, i++, 1, [](const std::string& p) { flip_byte(p, kvtier::kDiskPayloadOffset); });
  expect_corrupt(t, i++, 4096, [](const std::string& p) { flip_byte(p, kvtier::kDiskPayloadOffset + 4095); });
  // The zero rest of the header page.
  for (std::uint64_t off : {std::uint64_t{64}, std::uint64_t{2000}, kvtier::kDiskPayloadOffset - 1}) {
    expect_corrupt(t, i++, n, [&](const std::string& p) { flip_byte(p, off); });
  }
  // Every header field: magic, version, hash, meta, payload length, payload CRC, reserved, CRC.
  for (std::uint64_t off : {0, 4, 8, 23, 24, 28, 32, 36, 40, 47, 48, 52, 56, 60, 63}) {
    expect_corrupt(t, i++, n, [&](const std::string& p) { flip_byte(p, off); });
  }
  // Truncations: inside the payload, to the header page, into it, to nothing, one byte short of
  // the padding, a whole page short.
  const std::uint64_t fb = DiskTier::file_bytes_for(n);  // 5 pages
  for (std::uint64_t len : {kvtier::kDiskPayloadOffset + n / 2, kvtier::kDiskPayloadOffset, std::uint64_t{64},
                            std::uint64_t{0}, fb - 1, fb - 4096}) {
    expect_corrupt(t, i++, n, [&](const std::string& p) { CHECK(::truncate(p.c_str(), static_cast<off_t>(len)) == 0); });
  }
  // Grown by a page.
  expect_corrupt(t, i++, n, [&](const std::string& p) { CHECK(::truncate(p.c_str(), static_cast<off_t>(fb + 4096)) == 0); });
  // The file of another block under this name (hash mismatch).
  {
    const BlockHash other = make_hash(5000);
    CHECK(put(t, other, n) == DiskStatus::kOk);
    expect_corrupt(t, i++, n, [&](const std::string& p) {
      std::filesystem::copy_file(t.block_path(other), p, std::filesystem::copy_options::overwrite_existing);
    });
    CHECK(read_matches(t, other, n));
  }
  // Wrong expected meta, one field at a time: kCorrupt and dropped.
  for (int field = 0; field < 5; ++field) {
    const BlockHash h = make_hash(i++);
    CHECK(put(t, h, n) == DiskStatus::kOk);
    BlockMeta m = make_meta(n);
    if (field == 0) m.num_layers += 1;
    if (field == 1) m.page_size += 1;
    if (field == 2) m.row_bytes += 1;
    if (field == 3) m.dtype += 1;
    if (field == 4) m.payload_bytes -= 1;
    std::vector<std::uint8_t> out(n);
    CHECK(t.read(h, m, out.data(), out.size()) == DiskStatus::kCorrupt);
    CHECK(!t.contains(h) && !exists(t.block_path(h)));
  }
  // A file deleted behind the tier's back: kMissing, and the index forgets it.
  {
    const BlockHash h = make_hash(i++);
    CHECK(put(t, h, n) == DiskStatus::kOk);
    CHECK(::unlink(t.block_path(h).c_str()) == 0);
    DiskStatus st;
    CHECK(!read_matches(t, h, n, &st) && st == DiskStatus::kMissing);
    CHECK(!t.contains(h));
  }
  CHECK(!read_matches(t, make_hash(123456), 10) && t.read(make_hash(123456), make_meta(0), nullptr, 0) == DiskStatus::kMissing);
  CHECK(read_matches(t, make_hash(1000), 777));
  CHECK(t.num_blocks() == 2);
  check_consistent(t);
}

void test_restart() {
  TempDir dir;
  std::vector<std::uint64_t> sizes = {1, 5000, 4096 - 64, 70000, 123, 9999};
  std::uint64_t intact_used = 0;
  std::set<BlockHash> intact;
  std::string stray_tmp, foreign, payload_flipped, truncated, misnamed;
  {
    DiskTier t(dir.path, std::uint64_t{1} << 30);
    for (std::size_t i = 0; i < sizes.size(); ++i) CHECK(put(t, make_hash(static_cast<std::int64_t>(i)), sizes[i]) == DiskStatus::kOk);
    payload_flipped = t.block_path(make_hash(1));
    flip_byte(payload_flipped, kvtier::kDiskPayloadOffset + 4000);
    truncated = t.block_path(make_hash(3));
    CHECK(::truncate(truncated.c_str(), 4096) == 0);
    for (std::size_t i : {0, 2, 4, 5}) {
      intact.insert(make_hash(static_cast<std::int64_t>(i)));
      intact_used += DiskTier::file_bytes_for(sizes[i]);
    }
    // A crash mid-write leaves a temp file; a copy under another hash's name is corrupt.
    const std::string p0 = t.block_path(make_hash(0));
    stray_tmp = p0.substr(0, p0.size() - 4) + ".17.tmp";
    std::filesystem::copy_file(p0, stray_tmp);
    misnamed = t.block_path(make_hash(77));
    std::filesystem::copy_file(p0, misnamed);
    foreign = dir.sub("README.txt");
    write_file(foreign, "not a block");
  }
  DiskTier t(dir.path, std::uint64_t{1} << 30);
  CHECK(t.num_blocks() == intact.size() && t.used_bytes() == intact_used);
  std::set<BlockHash> found;
  for (const auto& hm : t.blocks()) {
    found.insert(hm.first);
    const std::size_t i = static_cast<std::size_t>(std::find(sizes.begin(), sizes.end(), hm.second.payload_bytes) - sizes.begin());
    CHECK(i < sizes.size() && hm.first == make_hash(static_cast<std::int64_t>(i)) && hm.second == make_meta(sizes[i]));
  }
  CHECK(found == intact);
  CHECK(!exists(stray_tmp) && !exists(payload_flipped) && !exists(truncated) && !exists(misnamed));
  CHECK(exists(foreign));  // not ours: left alone
  for (std::size_t i : {0, 2, 4, 5}) CHECK(read_matches(t, make_hash(static_cast<std::int64_t>(i)), sizes[i]));
  check_consistent(t);
  // scan() again returns the same set and changes nothing.
  const auto again = t.scan();
  CHECK(again.size() == intact.size() && t.used_bytes() == intact_used);
  // Restart with a smaller capacity: blocks are kept, new writes refused until evicted.
  DiskTier small(dir.path, DiskTier::file_bytes_for(1));
  CHECK(small.num_blocks() == intact.size() && small.used_bytes() > small.capacity_bytes());
  CHECK(put(small, make_hash(50), 1) == DiskStatus::kFull);
}

// 8 threads write, read and remove a pool of shared hashes plus their own private ones.
void test_concurrent(std::uint64_t capacity) {
  TempDir dir;
  DiskTier t(dir.path, capacity);
  constexpr int kThreads = 8, kShared = 24, kPrivate = 16, kOps = 600;
  auto size_of = [](std::int64_t id) { return static_cast<std::uint64_t>(1 + (id * 2654435761u) % 20000); };
  std::atomic<int> bad{0}, ok_reads{0}, fulls{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kThreads; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 rng(static_cast<std::uint32_t>(w + 1));
      std::set<std::int64_t> mine_stored;
      for (int op = 0; op < kOps; ++op) {
        const bool shared = rng() % 2 == 0;
        const std::int64_t id = shared ? static_cast<std::int64_t>(rng() % kShared)
                                       : 1000 + 100 * w + static_cast<std::int64_t>(rng() % kPrivate);
        const BlockHash h = make_hash(id);
        const std::uint32_t what = rng() % 10;
        if (what < 4) {
          const DiskStatus st = put(t, h, size_of(id));
          if (st == DiskStatus::kFull) fulls++;
          else if (st != DiskStatus::kOk) bad++;
          else if (!shared) mine_stored.insert(id);
        } else if (what < 9) {
          DiskStatus st;
          const bool match = read_matches(t, h, size_of(id), &st);
          if (st == DiskStatus::kOk && !match) bad++;
          if (st != DiskStatus::kOk && st != DiskStatus::kMissing) bad++;
          if (!shared && mine_stored.count(id) != 0 && st != DiskStatus::kOk) bad++;  // nobody else removes it
          if (st == DiskStatus::kOk) ok_reads++;
        } else {
          t.remove(h);
          if (!shared) mine_stored.erase(id);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(bad.load() == 0);
  CHECK(ok_reads.load() > 0);
  CHECK(t.used_bytes() <= t.capacity_bytes());
  check_consistent(t);
  // Every block the tier lists is intact, and a restart finds the same ones.
  const auto listed = t.blocks();
  for (const auto& hm : listed) {
    std::vector<std::uint8_t> out(hm.second.payload_bytes);
    CHECK(t.read(hm.first, hm.second, out.data(), out.size()) == DiskStatus::kOk);
    CHECK(out == make_payload(hm.first, hm.second.payload_bytes));
  }
  DiskTier again(dir.path, capacity);
  CHECK(again.num_blocks() == listed.size() && again.used_bytes() == t.used_bytes());
  std::printf("  concurrent (capacity %llu): %zu blocks, %d ok reads, %d kFull writes, direct_io=%d\n",
              static_cast<unsigned long long>(capacity), listed.size(), ok_reads.load(), fulls.load(),
              t.direct_io() ? 1 : 0);
}

// A 1 MiB tmpfs: the filesystem fills up long before capacity_bytes.
void test_full_filesystem() {
  TempDir dir;
  const std::string mnt = dir.sub("mnt");
  CHECK(::mkdir(mnt.c_str(), 0755) == 0);
  if (!mount_fs("tmpfs", mnt, "size=1m")) {
    std::printf("  full filesystem: skipped (mount tmpfs failed: %s)\n", std::strerror(errno));
    return;
  }
  bool direct = false;
  std::size_t stored = 0;
  DiskStatus last = DiskStatus::kOk;
  {
    DiskTier t(mnt, std::uint64_t{1} << 30);
    direct = t.direct_io();
    const std::uint64_t n = 100000;  // 102400 bytes on disk: 10 fit in 1 MiB at best
    for (int i = 0; i < 100 && last == DiskStatus::kOk; ++i) {
      last = put(t, make_hash(i), n);
      if (last == DiskStatus::kOk) stored++;
    }
    CHECK(last == DiskStatus::kFull || last == DiskStatus::kIoError);
    CHECK(stored >= 5 && stored <= 10);
    CHECK(t.num_blocks() == stored);
    check_consistent(t);  // no partial or temp file left
    for (std::size_t i = 0; i < stored; ++i) CHECK(read_matches(t, make_hash(static_cast<std::int64_t>(i)), n));
    // A block larger than the whole filesystem.
    const DiskStatus big = put(t, make_hash(500), 2 << 20);
    CHECK(big == DiskStatus::kFull || big == DiskStatus::kIoError);
    check_consistent(t);
    // Room again after a removal.
    CHECK(t.remove(make_hash(0)));
    CHECK(put(t, make_hash(501), n) == DiskStatus::kOk);
    check_consistent(t);
  }
  {
    DiskTier t(mnt, std::uint64_t{1} << 30);
    CHECK(t.num_blocks() == stored);
    for (std::size_t i = 1; i < stored; ++i) CHECK(read_matches(t, make_hash(static_cast<std::int64_t>(i)), 100000));
    CHECK(read_matches(t, make_hash(501), 100000));
  }
  unmount(mnt);
  std::printf("  full filesystem: %zu blocks stored, then %s (direct_io=%d)\n", stored, kvtier::to_string(last),
              direct ? 1 : 0);
}

// ramfs rejects O_DIRECT (EINVAL on open): the tier must fall back to buffered I/O.
void test_direct_io_fallback() {
  TempDir dir;
  const std::string mnt = dir.sub("mnt");
  CHECK(::mkdir(mnt.c_str(), 0755) == 0);
  if (!mount_fs("ramfs", mnt, nullptr)) {
    std::printf("  O_DIRECT fallback: skipped (mount ramfs failed: %s)\n", std::strerror(errno));
    return;
  }
  {
    DiskTier t(mnt, std::uint64_t{1} << 30, /*try_direct_io=*/true);
    std::printf("  ramfs: direct_io=%d\n", t.direct_io() ? 1 : 0);
    for (std::uint64_t n : {std::uint64_t{1}, std::uint64_t{5000}, std::uint64_t{70000}}) {
      CHECK(put(t, make_hash(static_cast<std::int64_t>(n)), n) == DiskStatus::kOk);
      CHECK(read_matches(t, make_hash(static_cast<std::int64_t>(n)), n));
    }
    check_consistent(t);
  }
  unmount(mnt);
}

}  // namespace

// After LMCache #559: the tier's own directory removed behind its back (an operator restoring
// the cache directory with `rm -rf d; mkdir d`) is made again by the next write, and stores go on;
// the blocks that were in it read as missing and are dropped.
void test_directory_recreated() {
  TempDir dir;
  DiskTier t(dir.sub("ns"), std::uint64_t{1} << 20);
  const BlockHash old_block = make_hash(1);
  CHECK(put(t, old_block, 3000) == DiskStatus::kOk);
  std::filesystem::remove_all(t.dir());
  CHECK(!exists(t.dir()));
  const BlockHash fresh = make_hash(2);
  CHECK(put(t, fresh, 3000) == DiskStatus::kOk);
  CHECK(exists(t.block_path(fresh)));
  CHECK(read_matches(t, fresh, 3000));
  std::vector<std::uint8_t> out(3000);
  CHECK(t.read(old_block, make_meta(3000), out.data(), out.size()) == DiskStatus::kMissing);
  CHECK(!t.contains(old_block));
  check_consistent(t);
}

int main() {
  {
    TempDir dir;
    DiskTier probe(dir.path, 1 << 20);
    std::printf("  /tmp: direct_io=%d\n", probe.direct_io() ? 1 : 0);
  }
  CHECK(std::string(kvtier::to_string(DiskStatus::kCorrupt)) == "corrupt");
  test_round_trip(true);
  test_round_trip(false);
  test_existing_hash();
  test_capacity();
  test_corruption();
  test_restart();
  test_concurrent(std::uint64_t{1} << 30);
  test_concurrent(32 * 4096);  // tight: many kFull refusals
  test_full_filesystem();
  test_direct_io_fallback();
  test_directory_recreated();
  std::printf("disk_tier: ok\n");
  return 0;
}
