#include "token_buffer.h"

#include <openssl/sha.h>

#include <cstring>
#include <stdexcept>
#include <string>

namespace kvtier {

TokenBuffer::TokenBuffer(std::size_t page_size, const std::uint8_t* salt, std::size_t salt_len)
    : page_size_(page_size), salt_(salt, salt + salt_len) {
  if (page_size == 0) throw std::invalid_argument("page_size must be > 0, got 0");
  // Same byte layout as block_hash_next(); only the parent and the page's ids change per block.
  msg_.resize(kBlockHashBytes + 4 + salt_len + 4 * page_size);
  const auto len = static_cast<std::uint32_t>(salt_len);
  for (int i = 0; i < 4; ++i) msg_[kBlockHashBytes + i] = static_cast<std::uint8_t>(len >> (8 * i));
  if (salt_len > 0) std::memcpy(msg_.data() + kBlockHashBytes + 4, salt, salt_len);
}

void TokenBuffer::append(const std::uint32_t* ids, std::size_t n) {
  if (n == 0) return;
  ids_.insert(ids_.end(), ids, ids + n);
  const std::size_t full = ids_.size() / page_size_;
  if (full == hashes_.size()) return;
  hashes_.reserve(full);
  std::uint8_t* body = msg_.data() + kBlockHashBytes + 4 + salt_.size();
  std::uint8_t digest[SHA256_DIGEST_LENGTH];
  BlockHash prev = last_hash();
  for (std::size_t b = hashes_.size(); b < full; ++b) {
    std::memcpy(msg_.data(), prev.data(), kBlockHashBytes);
    const std::uint32_t* page = ids_.data() + b * page_size_;
    for (std::size_t i = 0; i < page_size_; ++i) {
      const std::uint32_t t = page[i];
      body[4 * i + 0] = static_cast<std::uint8_t>(t);
      body[4 * i + 1] = static_cast<std::uint8_t>(t >> 8);
      body[4 * i + 2] = static_cast<std::uint8_t>(t >> 16);
      body[4 * i + 3] = static_cast<std::uint8_t>(t >> 24);
    }
    SHA256(msg_.data(), msg_.size(), digest);
    std::memcpy(prev.data(), digest, kBlockHashBytes);
    hashes_.push_back(prev);
  }
}

void TokenBuffer::truncate(std::size_t n) {
  if (n > ids_.size())
    throw std::out_of_range("truncate: n must be <= size (" + std::to_string(ids_.size()) + "), got " +
                            std::to_string(n));
  ids_.resize(n);  // shrinking never reallocates
  hashes_.resize(n / page_size_);
}

void TokenBuffer::reserve(std::size_t capacity) { ids_.reserve(capacity); }

}  // namespace kvtier
