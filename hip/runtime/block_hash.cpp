#include "block_hash.h"

#include <openssl/sha.h>

#include <cstring>

namespace kvtier {
namespace {

void put_le_u32(std::vector<std::uint8_t>* buf, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) buf->push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

}  // namespace

BlockHash block_hash_root() { return BlockHash{}; }

BlockHash block_hash_next(const BlockHash& parent, const std::int64_t* tokens, std::size_t page_size,
                          const std::uint8_t* salt, std::size_t salt_len) {
  std::vector<std::uint8_t> msg;
  msg.reserve(kBlockHashBytes + 4 + salt_len + 4 * page_size);
  msg.insert(msg.end(), parent.begin(), parent.end());
  put_le_u32(&msg, static_cast<std::uint32_t>(salt_len));
  if (salt_len > 0) msg.insert(msg.end(), salt, salt + salt_len);
  for (std::size_t i = 0; i < page_size; ++i) put_le_u32(&msg, static_cast<std::uint32_t>(tokens[i]));
  std::uint8_t digest[SHA256_DIGEST_LENGTH];
  SHA256(msg.data(), msg.size(), digest);
  BlockHash out;
  std::memcpy(out.data(), digest, kBlockHashBytes);
  return out;
}

std::vector<BlockHash> block_hashes(const std::int64_t* tokens, std::size_t num_tokens,
                                    std::size_t page_size, const BlockHash& parent,
                                    const std::uint8_t* salt, std::size_t salt_len) {
  std::vector<BlockHash> out;
  if (page_size == 0) return out;
  const std::size_t num_blocks = num_tokens / page_size;
  out.reserve(num_blocks);
  BlockHash prev = parent;
  for (std::size_t b = 0; b < num_blocks; ++b) {
    prev = block_hash_next(prev, tokens + b * page_size, page_size, salt, salt_len);
    out.push_back(prev);
  }
  return out;
}

}  // namespace kvtier
