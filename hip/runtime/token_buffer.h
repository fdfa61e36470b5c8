// Fused per-session token buffer: the session's token ids plus the chain of block hashes of
// its full pages, kept up to date as ids are appended or rolled back.
//
// The cache lookup for a new turn then costs O(new tokens): appending n ids hashes only the
// pages those ids complete, and truncating is O(1) in the ids (the hashes of pages that are no
// longer full are dropped). The hashes are exactly block_hashes() of block_hash.h over ids()
// with the same page_size and salt, chained from block_hash_root(); tests compare the two.
//
// Not thread-safe: one caller at a time (the Python binding serialises calls).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "block_hash.h"

namespace kvtier {

class TokenBuffer {
 public:
  // page_size: tokens per block (> 0, else std::invalid_argument).
  // salt:      [salt_len] bytes (copied), may be nullptr when salt_len == 0.
  TokenBuffer(std::size_t page_size, const std::uint8_t* salt, std::size_t salt_len);

  // Appends ids[0:n] and hashes every page they complete. ids may be nullptr when n == 0.
  // May reallocate the id storage (see capacity()).
  void append(const std::uint32_t* ids, std::size_t n);

  // Keeps ids[0:n] and the hashes of the n / page_size pages still full; never reallocates.
  // n > size() throws std::out_of_range.
  void truncate(std::size_t n);

  // Grows the id storage to hold at least `capacity` ids without reallocating.
  void reserve(std::size_t capacity);

  std::size_t size() const { return ids_.size(); }
  std::size_t capacity() const { return ids_.capacity(); }
  // [size()] token ids; valid until the next append that exceeds capacity().
  const std::uint32_t* ids() const { return ids_.data(); }
  // Number of full pages = size() / page_size.
  std::size_t num_blocks() const { return hashes_.size(); }
  // [num_blocks()] chained hashes; hashes()[i] covers ids[i*page_size : (i+1)*page_size].
  const std::vector<BlockHash>& hashes() const { return hashes_; }
  // Hash of the last full page, block_hash_root() when there is none.
  BlockHash last_hash() const { return hashes_.empty() ? block_hash_root() : hashes_.back(); }
  std::size_t page_size() const { return page_size_; }
  const std::vector<std::uint8_t>& salt() const { return salt_; }

 private:
  std::size_t page_size_;
  std::vector<std::uint8_t> salt_;
  std::vector<std::uint32_t> ids_;
  std::vector<BlockHash> hashes_;
  // Reused hash input: parent (16) || le_u32(len(salt)) || salt || le_u32 ids of one page.
  std::vector<std::uint8_t> msg_;
};

}  // namespace kvtier
