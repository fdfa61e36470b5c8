// SSD tier of the tiered KV pool: one file per KV block in a directory, named by the block hash
// (block_hash.h), checksummed so a crash or a bad disk never serves a wrong block.
//
// File "<32 lowercase hex digits of the hash>.kvb", format version 2, integers little-endian:
//
//   offset size  field
//        0    4  magic          "KVTB" (bytes 4B 56 54 42)
//        4    4  version        kDiskFormatVersion (2)
//        8   16  hash           the block hash (must match the file name)
//       24    4  num_layers     BlockMeta::num_layers
//       28    4  page_size      BlockMeta::page_size (tokens per block)
//       32    4  row_bytes      BlockMeta::row_bytes (bytes per token per layer)
//       36    4  dtype          BlockMeta::dtype (code chosen by the caller; Python packs the dtype
//                              in bits 0-7 and a page layout code in bits 8-31, kvtier/cache/block_layout.py)
//       40    8  payload_bytes  BlockMeta::payload_bytes (true payload length)
//       48    4  payload_crc    CRC-32C of the payload bytes
//       52    8  reserved       zero
//       60    4  header_crc     CRC-32C of bytes [0, 60)
//       64 4032  zero           rest of the header page (checked to be zero)
//     4096    -  payload        payload_bytes opaque bytes
//        -    -  padding        zero bytes up to the next multiple of kDiskAlign
//
// The file length is always file_bytes_for(payload_bytes) = 4096 + round_up(payload_bytes, 4096),
// whatever the I/O mode, so a directory written with O_DIRECT can be read buffered and back.
// The header has a page to itself so that the payload sits page-aligned in the file: with
// O_DIRECT and a caller buffer on a 4096-byte boundary, write() and read() move the whole file
// with one pwritev/preadv straight from/to that buffer (header page and the last, partial payload
// page go through small per-thread pages). Any other buffer is copied through a per-thread bounce
// buffer; buffered I/O never needs one. Version 1 files (64-byte header before the payload) are
// not read: scan() deletes them as corrupt.
//
// Checksum: CRC-32C (Castagnoli, crc32c.h): the SSE4.2 crc32 instruction on three streams where
// the CPU has it (~0.2 ms per 4.5 MB block, against ~1.1-1.8 ms for zlib's CRC-32, which made
// the checksum the largest cost of a block), a portable table loop with the same values
// elsewhere. It guards against torn writes, truncation and bit rot, not against an attacker (the
// directory is trusted): it catches every error burst of up to 32 bits and any other random
// corruption with probability 1 - 2^-32.
//
// Crash safety: a block is written to "<hex>.<n>.tmp" in the same directory and renamed over
// "<hex>.kvb"; a reader only ever opens final names of blocks whose write has returned. There is
// no fsync of the directory and, with O_DIRECT, no fdatasync: the data has reached the device
// when pwritev returns, and the metadata (file size, extents, the rename) becomes durable with
// the filesystem's next journal commit (ext4: within 5 s). (Buffered I/O is fdatasync'ed, which
// is what surfaces its write-back errors.) A crash or power loss can therefore lose the blocks
// written in the last seconds, or leave a final file that is empty, short, zero-filled or holds
// a mix of old and new pages; scan() at start-up checks the length, the header (magic, version,
// CRC, hash) and the payload CRC of every file and deletes whatever fails, together with temp
// files. This is a cache: a lost block is a miss, recomputed later; a damaged one is never served.
// A caller that needs a block durable at a point in time can syncfs() the directory.
//
// Thread safety: every public method may be called from any thread. File I/O runs outside the
// index mutex, so writes and reads of different blocks proceed in parallel; only scan() excludes
// the other operations while it runs. One DiskTier per directory (no cross-process locking).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "block_hash.h"
#include "prefix_index.h"  // BlockHashHasher

namespace kvtier {

constexpr std::uint32_t kDiskFormatVersion = 2;
constexpr std::uint64_t kDiskAlign = 4096;          // O_DIRECT buffer, offset and length alignment
constexpr std::uint64_t kDiskHeaderBytes = 64;      // encoded header fields
constexpr std::uint64_t kDiskPayloadOffset = 4096;  // the header page: fields, then zeros

// What a block file holds besides its payload; read() must be given the same values.
struct BlockMeta {
  std::uint32_t num_layers = 0;
  std::uint32_t page_size = 0;
  std::uint32_t row_bytes = 0;  // bytes per token per layer
  std::uint32_t dtype = 0;      // caller-defined code
  std::uint64_t payload_bytes = 0;

  bool operator==(const BlockMeta& o) const {
    return num_layers == o.num_layers && page_size == o.page_size && row_bytes == o.row_bytes &&
           dtype == o.dtype && payload_bytes == o.payload_bytes;
  }
  bool operator!=(const BlockMeta& o) const { return !(*this == o); }
};

enum class DiskStatus : int {
  kOk = 0,
  kMissing = 1,      // no such block
  kCorrupt = 2,      // failed a check; the file has been deleted
  kFull = 3,         // over capacity_bytes, or the filesystem is full (ENOSPC/EDQUOT)
  kIoError = 4,      // any other OS error (a failed write leaves nothing; a failed read keeps the file)
  kTooLarge = 5,     // the block alone is larger than capacity_bytes: it can never fit
  kBadArgument = 6,  // null payload/out buffer, or out_bytes < expected.payload_bytes
};
const char* to_string(DiskStatus s);

class DiskTier {
 public:
  // Creates `dir` if missing, detects whether O_DIRECT works there (when try_direct_io), then
  // scan()s it so the blocks of a previous run are known (see blocks()). Throws
  // std::runtime_error if the directory cannot be created or opened.
  DiskTier(std::string dir, std::uint64_t capacity_bytes, bool try_direct_io = true);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // Stores a block. kOk without writing when the hash is already stored (content-addressed: the
  // existing file is kept, whatever `meta` says); a concurrent write of the same hash waits for
  // the first one. kFull (nothing written) when used_bytes() + file_bytes_for(payload) would
  // exceed capacity_bytes(), or when the filesystem runs out of space; on any failure the temp
  // file is removed and the blocks stored before are untouched.
  DiskStatus write(const BlockHash& hash, const BlockMeta& meta, const void* payload);

  // Copies the payload of a block into out[0, expected.payload_bytes). Verifies magic, version,
  // header CRC, hash, meta == expected, file length and payload CRC; on any mismatch the file is
  // deleted and kCorrupt returned (also for a wrong `expected`: such a block can never be
  // served). Never writes past out_bytes. On a non-kOk status `out` may hold garbage.
  DiskStatus read(const BlockHash& hash, const BlockMeta& expected, void* out, std::uint64_t out_bytes);

  bool remove(const BlockHash& hash);  // false if not stored
  bool contains(const BlockHash& hash) const;
  std::uint64_t used_bytes() const;  // sum of file_bytes_for() over stored blocks
  std::uint64_t capacity_bytes() const { return capacity_bytes_; }
  std::size_t num_blocks() const;
  bool direct_io() const { return direct_io_; }  // O_DIRECT active (decided once, at construction)
  const std::string& dir() const { return dir_; }

  // Rebuilds the index from the directory: validates every block file (header and payload
  // CRC), deletes corrupt or truncated ones and leftover temp files, resets used_bytes() and
  // returns the intact blocks. Reads every byte, so it costs a full pass over the directory.
  // Runs exclusively (waits for in-flight operations). Blocks over capacity are kept; the
  // caller evicts. Other files in the directory are left alone.
  std::vector<std::pair<BlockHash, BlockMeta>> scan();

  // Snapshot of the stored blocks (no I/O): after construction, what the start-up scan found.
  std::vector<std::pair<BlockHash, BlockMeta>> blocks() const;

  std::string block_path(const BlockHash& hash) const;  // "<dir>/<hex>.kvb"
  static std::uint64_t file_bytes_for(std::uint64_t payload_bytes);  // on-disk size of a block

 private:
  struct Entry {
    BlockMeta meta;
    std::uint64_t file_bytes;
    std::uint64_t gen;  // tells a re-written block from the one a reader looked up
  };
  using Map = std::unordered_map<BlockHash, Entry, BlockHashHasher>;
  enum class Reserve { kGo, kExists, kFull };

  Reserve reserve(const BlockHash& hash, std::uint64_t file_bytes);
  void finish_write(const BlockHash& hash, const BlockMeta& meta, std::uint64_t file_bytes, bool ok);
  bool drop(const BlockHash& hash, const std::uint64_t* gen);
  DiskStatus write_file(const BlockHash& hash, const BlockMeta& meta, const std::uint8_t* payload);
  DiskStatus load(const std::string& path, const BlockHash& hash, const BlockMeta* expected,
                  std::uint8_t* out, BlockMeta* meta_out) const;
  DiskStatus load_checked(const std::string& path, const BlockHash& hash, const BlockMeta* expected,
                          std::uint8_t* out, BlockMeta* meta_out) const;
  int open_flags(int base) const;
  std::string temp_path(const BlockHash& hash);

  const std::string dir_;
  const std::uint64_t capacity_bytes_;
  bool direct_io_ = false;
  std::atomic<std::uint64_t> next_temp_{0};  // makes temp file names unique

  std::shared_mutex scan_mu_;  // shared: write/read/remove; exclusive: scan
  mutable std::mutex mu_;      // guards everything below; never held during file I/O
  std::condition_variable cv_;  // signalled when a hash leaves busy_
  Map map_;
  std::unordered_set<BlockHash, BlockHashHasher> busy_;  // hashes with a write/unlink in flight
  std::uint64_t used_bytes_ = 0;
  std::uint64_t reserved_bytes_ = 0;  // file_bytes of writes in flight
  std::uint64_t next_gen_ = 0;
};

}  // namespace kvtier
