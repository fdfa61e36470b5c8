#include "disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <system_error>

#include "crc32c.h"

namespace kvtier {
namespace {

constexpr std::uint8_t kMagic[4] = {'K', 'V', 'T', 'B'};
constexpr const char* kBlockSuffix = ".kvb";
constexpr const char* kTempSuffix = ".tmp";
constexpr std::size_t kHexChars = 2 * kBlockHashBytes;
// Larger payloads are refused (write) or treated as corrupt (read): keeps size arithmetic far
// from overflow and a garbage header from asking for a huge buffer.
constexpr std::uint64_t kMaxPayloadBytes = std::uint64_t{1} << 40;

// Header field offsets; see the layout table in disk_tier.h.
enum : std::size_t {
  kOffMagic = 0, kOffVersion = 4, kOffHash = 8, kOffNumLayers = 24, kOffPageSize = 28,
  kOffRowBytes = 32, kOffDtype = 36, kOffPayloadBytes = 40, kOffPayloadCrc = 48,
  kOffReserved = 52, kOffHeaderCrc = 60,
};

// ---- little-endian fields and CRC -------------------------------------------------------------

void put_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void put_u64(std::uint8_t* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint32_t get_u32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
std::uint64_t get_u64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Fills h[0, kDiskHeaderBytes); the rest of the header page stays as it is (zero).
void encode_header(std::uint8_t* h, const BlockHash& hash, const BlockMeta& m, std::uint32_t payload_crc) {
  std::memset(h, 0, kDiskHeaderBytes);
  std::memcpy(h + kOffMagic, kMagic, sizeof(kMagic));
  put_u32(h + kOffVersion, kDiskFormatVersion);
  std::memcpy(h + kOffHash, hash.data(), kBlockHashBytes);
  put_u32(h + kOffNumLayers, m.num_layers);
  put_u32(h + kOffPageSize, m.page_size);
  put_u32(h + kOffRowBytes, m.row_bytes);
  put_u32(h + kOffDtype, m.dtype);
  put_u64(h + kOffPayloadBytes, m.payload_bytes);
  put_u32(h + kOffPayloadCrc, payload_crc);
  put_u32(h + kOffHeaderCrc, crc32c(h, kOffHeaderCrc));
}

// Checks everything the header page alone can tell; fills *meta and *payload_crc.
bool decode_header(const std::uint8_t* h, const BlockHash& hash, BlockMeta* meta, std::uint32_t* payload_crc) {
  if (std::memcmp(h + kOffMagic, kMagic, sizeof(kMagic)) != 0) return false;
  if (get_u32(h + kOffVersion) != kDiskFormatVersion) return false;
  if (get_u32(h + kOffHeaderCrc) != crc32c(h, kOffHeaderCrc)) return false;
  if (std::memcmp(h + kOffHash, hash.data(), kBlockHashBytes) != 0) return false;
  if (get_u64(h + kOffReserved) != 0) return false;
  for (std::uint64_t i = kDiskHeaderBytes; i < kDiskPayloadOffset; ++i)
    if (h[i] != 0) return false;
  meta->num_layers = get_u32(h + kOffNumLayers);
  meta->page_size = get_u32(h + kOffPageSize);
  meta->row_bytes = get_u32(h + kOffRowBytes);
  meta->dtype = get_u32(h + kOffDtype);
  meta->payload_bytes = get_u64(h + kOffPayloadBytes);
  *payload_crc = get_u32(h + kOffPayloadCrc);
  return meta->payload_bytes <= kMaxPayloadBytes;
}

// ---- names --------------------------------------------------------------------------------------

std::string to_hex(const BlockHash& h) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s(kHexChars, '0');
  for (std::size_t i = 0; i < kBlockHashBytes; ++i) {
    s[2 * i] = kDigits[h[i] >> 4];
    s[2 * i + 1] = kDigits[h[i] & 15];
  }
  return s;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// Parses the leading 32 lowercase hex digits of `name`.
bool parse_hex_prefix(const std::string& name, BlockHash* out) {
  if (name.size() < kHexChars) return false;
  for (std::size_t i = 0; i < kBlockHashBytes; ++i) {
    const int hi = hex_digit(name[2 * i]), lo = hex_digit(name[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    (*out)[i] = static_cast<std::uint8_t>(hi << 4 | lo);
  }
  return true;
}

bool ends_with(const std::string& s, const char* suffix) {
  const std::size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

bool is_block_name(const std::string& name, BlockHash* hash) {  // "<hex>.kvb"
  return name.size() == kHexChars + std::strlen(kBlockSuffix) && ends_with(name, kBlockSuffix) &&
         parse_hex_prefix(name, hash);
}

bool is_temp_name(const std::string& name) {  // "<hex>.<n>.tmp"
  BlockHash unused;
  return name.size() > kHexChars && name[kHexChars] == '.' && ends_with(name, kTempSuffix) &&
         parse_hex_prefix(name, &unused);
}

// ---- file I/O -----------------------------------------------------------------------------------

struct FreeDeleter {
  void operator()(std::uint8_t* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<std::uint8_t, FreeDeleter>;

std::uint64_t round_up(std::uint64_t n) { return (n + kDiskAlign - 1) / kDiskAlign * kDiskAlign; }

bool is_aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % kDiskAlign == 0; }

// `len` must be a multiple of kDiskAlign. Zero-filled when `zero`.
AlignedBuf aligned_buf(std::uint64_t len, bool zero = false) {
  void* p = std::aligned_alloc(kDiskAlign, static_cast<std::size_t>(len));
  if (p == nullptr) throw std::bad_alloc();
  if (zero) std::memset(p, 0, static_cast<std::size_t>(len));
  return AlignedBuf(static_cast<std::uint8_t*>(p));
}

// Per-thread aligned buffers, reused across calls (each copy thread allocates them once):
//   header:  the header page written; only write_file() touches it, and only its first
//            kDiskHeaderBytes, so the rest stays zero.
//   read_header: the header page read (whatever the file holds).
//   tail:   the last, partial payload page plus its zero padding.
//   bounce: the payload for O_DIRECT from/to a caller buffer that is not kDiskAlign-aligned,
//           and for scan(); at most one buffer of the largest payload per thread.
struct ThreadBufs {
  AlignedBuf header = aligned_buf(kDiskAlign, true);
  AlignedBuf read_header = aligned_buf(kDiskAlign);
  AlignedBuf tail = aligned_buf(kDiskAlign);
  AlignedBuf bounce;
  std::uint64_t bounce_cap = 0;

  std::uint8_t* bounce_of(std::uint64_t len) {
    if (bounce_cap < len) {
      bounce = aligned_buf(len);
      bounce_cap = len;
    }
    return bounce.get();
  }
};
ThreadBufs& thread_bufs() {
  thread_local ThreadBufs bufs;
  return bufs;
}

// The file as (up to) three pieces, all valid for O_DIRECT when `body` is aligned: the header
// page, the whole payload pages (payload_bytes rounded down) and the tail page.
struct Pieces {
  iovec iov[3];
  int n = 0;
  std::uint64_t bytes = 0;
  void add(void* p, std::uint64_t len) {
    if (len == 0) return;
    iov[n++] = iovec{p, static_cast<std::size_t>(len)};
    bytes += len;
  }
};

// Closes on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int release() {
    const int f = fd;
    fd = -1;
    return f;
  }
};

DiskStatus status_of_errno(int err) {
  if (err == ENOSPC || err == EDQUOT) return DiskStatus::kFull;
  if (err == ENOENT) return DiskStatus::kMissing;
  return DiskStatus::kIoError;
}

// Drops the first `done` bytes of the pieces (after a short transfer).
void advance(Pieces* pc, std::uint64_t done, int* first) {
  while (done > 0) {
    iovec& v = pc->iov[*first];
    if (done < v.iov_len) {
      v.iov_base = static_cast<std::uint8_t*>(v.iov_base) + done;
      v.iov_len -= static_cast<std::size_t>(done);
      return;
    }
    done -= v.iov_len;
    ++*first;
  }
}

// Writes the pieces at offset 0. A short write to a regular file means the filesystem ran out
// of space (and with O_DIRECT the rest could not be written at an unaligned offset anyway).
DiskStatus write_pieces(int fd, Pieces pc) {
  std::uint64_t done = 0;
  int first = 0;
  while (done < pc.bytes) {
    const ssize_t n = ::pwritev(fd, pc.iov + first, pc.n - first, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return status_of_errno(errno);
    if (static_cast<std::uint64_t>(n) < pc.bytes - done) return DiskStatus::kFull;
    done += static_cast<std::uint64_t>(n);
  }
  return DiskStatus::kOk;
}

// Reads the pieces from `offset`. kCorrupt when the file ends first.
DiskStatus read_pieces(int fd, Pieces pc, std::uint64_t offset) {
  std::uint64_t done = 0;
  int first = 0;
  while (done < pc.bytes) {
    const ssize_t n = ::preadv(fd, pc.iov + first, pc.n - first, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return DiskStatus::kIoError;
    if (n == 0) return DiskStatus::kCorrupt;
    done += static_cast<std::uint64_t>(n);
    advance(&pc, static_cast<std::uint64_t>(n), &first);
  }
  return DiskStatus::kOk;
}

// Can a file in `dir` be opened with O_DIRECT and written with an aligned buffer? (tmpfs before
// Linux 6.6 and some FUSE filesystems answer EINVAL.) Any failure means "use buffered I/O".
bool probe_direct_io(const std::string& dir) {
  const std::string path = dir + "/.kvtier-direct-probe" + kTempSuffix;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  bool ok = fd >= 0;
  if (ok) {
    AlignedBuf buf = aligned_buf(kDiskAlign, true);
    Pieces pc;
    pc.add(buf.get(), kDiskAlign);
    ok = write_pieces(fd, pc) == DiskStatus::kOk;
    ::close(fd);
  }
  ::unlink(path.c_str());  // even when open failed: Linux creates the file before refusing O_DIRECT
  return ok;
}

}  // namespace

const char* to_string(DiskStatus s) {
  switch (s) {
    case DiskStatus::kOk: return "ok";
    case DiskStatus::kMissing: return "missing";
    case DiskStatus::kCorrupt: return "corrupt";
    case DiskStatus::kFull: return "full";
    case DiskStatus::kIoError: return "io_error";
    case DiskStatus::kTooLarge: return "too_large";
    case DiskStatus::kBadArgument: return "bad_argument";
  }
  return "unknown";
}

std::uint64_t DiskTier::file_bytes_for(std::uint64_t payload_bytes) {
  return kDiskPayloadOffset + round_up(payload_bytes);
}

// ---- construction -------------------------------------------------------------------------------

DiskTier::DiskTier(std::string dir, std::uint64_t capacity_bytes, bool try_direct_io)
    : dir_(std::move(dir)), capacity_bytes_(capacity_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw std::runtime_error("DiskTier: cannot create " + dir_ + ": " + ec.message());
  const int dir_fd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) throw std::runtime_error("DiskTier: cannot open " + dir_ + ": " + std::strerror(errno));
  ::close(dir_fd);
  direct_io_ = try_direct_io && probe_direct_io(dir_);
  scan();
}

DiskTier::~DiskTier() = default;

std::string DiskTier::block_path(const BlockHash& hash) const { return dir_ + "/" + to_hex(hash) + kBlockSuffix; }

std::string DiskTier::temp_path(const BlockHash& hash) {
  return dir_ + "/" + to_hex(hash) + "." + std::to_string(next_temp_++) + kTempSuffix;
}

int DiskTier::open_flags(int base) const { return base | O_CLOEXEC | (direct_io_ ? O_DIRECT : 0); }

// ---- write --------------------------------------------------------------------------------------

DiskStatus DiskTier::write(const BlockHash& hash, const BlockMeta& meta, const void* payload) {
  if (payload == nullptr && meta.payload_bytes > 0) return DiskStatus::kBadArgument;
  if (meta.payload_bytes > kMaxPayloadBytes) return DiskStatus::kTooLarge;
  const std::uint64_t file_bytes = file_bytes_for(meta.payload_bytes);
  if (file_bytes > capacity_bytes_) return DiskStatus::kTooLarge;

  std::shared_lock<std::shared_mutex> no_scan(scan_mu_);
  switch (reserve(hash, file_bytes)) {
    case Reserve::kExists: return DiskStatus::kOk;
    case Reserve::kFull: return DiskStatus::kFull;
    case Reserve::kGo: break;
  }
  DiskStatus st = DiskStatus::kIoError;
  try {
    st = write_file(hash, meta, static_cast<const std::uint8_t*>(payload));
  } catch (const std::bad_alloc&) {
    st = DiskStatus::kIoError;
  }
  finish_write(hash, meta, file_bytes, st == DiskStatus::kOk);
  return st;
}

// Under mu_: waits out an in-flight write or unlink of the same hash, then either finds the
// block stored, or refuses for capacity, or marks the hash busy and reserves its bytes.
DiskTier::Reserve DiskTier::reserve(const BlockHash& hash, std::uint64_t file_bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return busy_.count(hash) == 0; });
  if (map_.count(hash) != 0) return Reserve::kExists;
  if (used_bytes_ + reserved_bytes_ + file_bytes > capacity_bytes_) return Reserve::kFull;
  busy_.insert(hash);
  reserved_bytes_ += file_bytes;
  return Reserve::kGo;
}

void DiskTier::finish_write(const BlockHash& hash, const BlockMeta& meta, std::uint64_t file_bytes, bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_bytes_ -= file_bytes;
    busy_.erase(hash);
    if (ok) {
      map_[hash] = Entry{meta, file_bytes, next_gen_++};
      used_bytes_ += file_bytes;
    }
  }
  cv_.notify_all();
}

// temp file -> one pwritev (header page, payload pages, tail page) -> [fdatasync when buffered]
// -> close -> rename over the final name. No fsync of the directory: see "Crash safety" in
// disk_tier.h. On failure the temp file is unlinked and the final name untouched.
DiskStatus DiskTier::write_file(const BlockHash& hash, const BlockMeta& meta, const std::uint8_t* payload) {
  ThreadBufs& bufs = thread_bufs();
  encode_header(bufs.header.get(), hash, meta, crc32c(payload, meta.payload_bytes));
  const std::uint64_t body = meta.payload_bytes / kDiskAlign * kDiskAlign;
  const std::uint64_t tail = meta.payload_bytes - body;
  // O_DIRECT needs aligned memory: a caller buffer that is not goes through the bounce buffer.
  const std::uint8_t* src = payload;
  if (direct_io_ && body > 0 && !is_aligned(payload)) {
    std::uint8_t* bounce = bufs.bounce_of(body);
    std::memcpy(bounce, payload, body);
    src = bounce;
  }
  if (tail > 0) {
    std::memcpy(bufs.tail.get(), payload + body, tail);
    std::memset(bufs.tail.get() + tail, 0, kDiskAlign - tail);
  }
  Pieces pc;
  pc.add(bufs.header.get(), kDiskPayloadOffset);
  pc.add(const_cast<std::uint8_t*>(src), body);
  pc.add(bufs.tail.get(), tail > 0 ? kDiskAlign : 0);

  const std::string tmp = temp_path(hash);
  Fd fd(::open(tmp.c_str(), open_flags(O_WRONLY | O_CREAT | O_EXCL), 0644));
  if (fd.fd < 0 && errno == ENOENT) {
    // The directory was removed behind the tier's back (an operator who restores the cache
    // directory by emptying and recreating it): make it again and go on storing. Blocks that
    // were in it read as missing and are dropped then.
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (!ec) fd.fd = ::open(tmp.c_str(), open_flags(O_WRONLY | O_CREAT | O_EXCL), 0644);
  }
  if (fd.fd < 0) {
    const DiskStatus st = status_of_errno(errno);
    return st == DiskStatus::kMissing ? DiskStatus::kIoError : st;  // the directory vanished
  }
  DiskStatus st = write_pieces(fd.fd, pc);
  // Buffered I/O only fills the page cache: write it back now so that its errors (EIO, a late
  // ENOSPC) fail this write. O_DIRECT has already handed the data to the device.
  if (st == DiskStatus::kOk && !direct_io_ && ::fdatasync(fd.fd) != 0) st = status_of_errno(errno);
  if (::close(fd.release()) != 0 && st == DiskStatus::kOk) st = status_of_errno(errno);
  if (st == DiskStatus::kOk && ::rename(tmp.c_str(), block_path(hash).c_str()) != 0) st = status_of_errno(errno);
  if (st != DiskStatus::kOk) {
    ::unlink(tmp.c_str());
    return st == DiskStatus::kMissing ? DiskStatus::kIoError : st;
  }
  return DiskStatus::kOk;
}

// ---- read ---------------------------------------------------------------------------------------

DiskStatus DiskTier::read(const BlockHash& hash, const BlockMeta& expected, void* out, std::uint64_t out_bytes) {
  if (out_bytes < expected.payload_bytes || (out == nullptr && expected.payload_bytes > 0)) {
    return DiskStatus::kBadArgument;
  }
  std::shared_lock<std::shared_mutex> no_scan(scan_mu_);
  std::uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = map_.find(hash);
    if (it == map_.end()) return DiskStatus::kMissing;
    gen = it->second.gen;
  }
  const DiskStatus st = load(block_path(hash), hash, &expected, static_cast<std::uint8_t*>(out), nullptr);
  // A corrupt file is dropped; a vanished one too (deleted behind our back). drop() only acts
  // if the entry is still the one looked up above, so a concurrent remove + re-write is safe.
  if (st == DiskStatus::kCorrupt || st == DiskStatus::kMissing) drop(hash, &gen);
  return st;
}

// Reads and verifies the block file at `path`. expected == nullptr: any meta is accepted.
// out == nullptr: only verify. meta_out may be nullptr.
DiskStatus DiskTier::load(const std::string& path, const BlockHash& hash, const BlockMeta* expected,
                          std::uint8_t* out, BlockMeta* meta_out) const {
  try {
    return load_checked(path, hash, expected, out, meta_out);
  } catch (const std::bad_alloc&) {
    return DiskStatus::kIoError;
  }
}

DiskStatus DiskTier::load_checked(const std::string& path, const BlockHash& hash, const BlockMeta* expected,
                                  std::uint8_t* out, BlockMeta* meta_out) const {
  Fd fd(::open(path.c_str(), open_flags(O_RDONLY)));
  if (fd.fd < 0) return status_of_errno(errno);
  struct stat sb;
  if (::fstat(fd.fd, &sb) != 0) return DiskStatus::kIoError;
  const auto file_bytes = static_cast<std::uint64_t>(sb.st_size);
  if (file_bytes < kDiskPayloadOffset || file_bytes % kDiskAlign != 0) return DiskStatus::kCorrupt;

  ThreadBufs& bufs = thread_bufs();
  BlockMeta meta;
  std::uint32_t payload_crc;
  if (expected == nullptr) {  // scan: the header says how long the payload is
    Pieces head;
    head.add(bufs.read_header.get(), kDiskPayloadOffset);
    const DiskStatus st = read_pieces(fd.fd, head, 0);
    if (st != DiskStatus::kOk) return st;
    if (!decode_header(bufs.read_header.get(), hash, &meta, &payload_crc)) return DiskStatus::kCorrupt;
  } else {
    meta = *expected;
  }
  if (meta.payload_bytes > kMaxPayloadBytes || file_bytes != file_bytes_for(meta.payload_bytes)) {
    return DiskStatus::kCorrupt;
  }

  // The whole file in one preadv: header page, payload pages straight into `out` when O_DIRECT
  // allows it (else via the bounce buffer), tail page.
  const std::uint64_t body = meta.payload_bytes / kDiskAlign * kDiskAlign;
  const std::uint64_t tail = meta.payload_bytes - body;
  const bool bounce = out == nullptr || (direct_io_ && body > 0 && !is_aligned(out));
  std::uint8_t* dst = bounce ? bufs.bounce_of(round_up(meta.payload_bytes)) : out;
  Pieces pc;
  pc.add(bufs.read_header.get(), kDiskPayloadOffset);
  pc.add(dst, body);
  pc.add(bufs.tail.get(), tail > 0 ? kDiskAlign : 0);
  const DiskStatus st = read_pieces(fd.fd, pc, 0);
  if (st != DiskStatus::kOk) return st;
  BlockMeta again;
  if (!decode_header(bufs.read_header.get(), hash, &again, &payload_crc) || again != meta) return DiskStatus::kCorrupt;
  std::uint32_t crc = crc32c(dst, body);
  crc = crc32c_extend(crc, bufs.tail.get(), tail);
  if (crc != payload_crc) return DiskStatus::kCorrupt;
  if (out != nullptr) {
    if (bounce) std::memcpy(out, dst, body);
    if (tail > 0) std::memcpy(out + body, bufs.tail.get(), tail);
  }
  if (meta_out != nullptr) *meta_out = meta;
  return DiskStatus::kOk;
}

// ---- remove -------------------------------------------------------------------------------------

bool DiskTier::remove(const BlockHash& hash) {
  std::shared_lock<std::shared_mutex> no_scan(scan_mu_);
  return drop(hash, nullptr);
}

// Forgets the block (only the entry of generation *gen when gen != nullptr) and unlinks its
// file outside the mutex; the hash stays busy meanwhile so no write of it can race the unlink.
bool DiskTier::drop(const BlockHash& hash, const std::uint64_t* gen) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = map_.find(hash);
    if (it == map_.end() || (gen != nullptr && it->second.gen != *gen)) return false;
    used_bytes_ -= it->second.file_bytes;
    map_.erase(it);
    busy_.insert(hash);
  }
  ::unlink(block_path(hash).c_str());
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_.erase(hash);
  }
  cv_.notify_all();
  return true;
}

// ---- index --------------------------------------------------------------------------------------

bool DiskTier::contains(const BlockHash& hash) const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.count(hash) != 0;
}

std::uint64_t DiskTier::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_bytes_;
}

std::size_t DiskTier::num_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.size();
}

std::vector<std::pair<BlockHash, BlockMeta>> DiskTier::blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<BlockHash, BlockMeta>> out;
  out.reserve(map_.size());
  for (const auto& kv : map_) out.emplace_back(kv.first, kv.second.meta);
  return out;
}

// ---- scan ---------------------------------------------------------------------------------------

std::vector<std::pair<BlockHash, BlockMeta>> DiskTier::scan() {
  std::unique_lock<std::shared_mutex> exclusive(scan_mu_);
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir_.c_str())) {
    while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    ::closedir(d);
  }
  Map found;
  std::uint64_t used = 0;
  std::vector<std::pair<BlockHash, BlockMeta>> out;
  for (const std::string& name : names) {
    const std::string path = dir_ + "/" + name;
    BlockHash hash;
    if (is_temp_name(name)) {
      ::unlink(path.c_str());  // a write interrupted by a crash
      continue;
    }
    if (!is_block_name(name, &hash)) continue;  // not ours
    BlockMeta meta;
    const DiskStatus st = load(path, hash, nullptr, nullptr, &meta);
    if (st == DiskStatus::kCorrupt) ::unlink(path.c_str());
    if (st != DiskStatus::kOk) continue;  // kIoError: left in place, not indexed
    const std::uint64_t file_bytes = file_bytes_for(meta.payload_bytes);
    found[hash] = Entry{meta, file_bytes, 0};
    used += file_bytes;
    out.emplace_back(hash, meta);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : found) kv.second.gen = next_gen_++;
    map_ = std::move(found);
    used_bytes_ = used;
  }
  return out;
}

}  // namespace kvtier
