// Chained block hash: the one definition of a KV block's identity (docs/architecture.md, "Contracts").
//
//   h_{-1} = 16 zero bytes
//   h_i    = SHA-256( h_{i-1}                      16 bytes
//                     || le_u32(len(salt)) || salt  4 + len(salt) bytes
//                     || le_u32(t) for each of the page_size token ids of block i )[0:16]
//
// Only full blocks are hashed. The salt isolates tenants: two different salts never share a
// chain. Width: 128 bits. With n = 1e9 distinct blocks, the birthday bound gives a collision
// probability of about n^2 / 2^129 ~= 1.5e-21.
// The pure-Python twin is kvtier.cache.block_hash.block_hashes_py; tests compare the two.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier {

constexpr std::size_t kBlockHashBytes = 16;
using BlockHash = std::array<std::uint8_t, kBlockHashBytes>;

// The hash of the block before the first one: 16 zero bytes.
BlockHash block_hash_root();

// Hash of one full block.
//   parent:    hash of the previous block (block_hash_root() for the first block)
//   tokens:    [page_size] token ids; each must be >= 0 (checked by the caller)
//   salt:      [salt_len] bytes, may be nullptr when salt_len == 0
BlockHash block_hash_next(const BlockHash& parent, const std::int64_t* tokens, std::size_t page_size,
                          const std::uint8_t* salt, std::size_t salt_len);

// Hashes of every full block of tokens[0:num_tokens] (num_tokens / page_size of them), chained
// from parent. A trailing partial block is ignored.
std::vector<BlockHash> block_hashes(const std::int64_t* tokens, std::size_t num_tokens,
                                    std::size_t page_size, const BlockHash& parent,
                                    const std::uint8_t* salt, std::size_t salt_len);

}  // namespace kvtier
