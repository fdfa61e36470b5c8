// Host test of the block hash: chaining, salt isolation, partial blocks.
#include <cstdio>
#include <vector>

#include "block_hash.h"
#include "check.h"


int main() {
  std::vector<std::int64_t> tokens(37);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int64_t>(i * 7919 % 163840);
  const auto root = kvtier::block_hash_root();
  const auto all = kvtier::block_hashes(tokens.data(), tokens.size(), 8, root, nullptr, 0);
  CHECK(all.size() == 4);  // 37 / 8: the partial block is not hashed
  // Chaining: continuing from hash 1 gives the same hashes 2..3.
  const auto tail = kvtier::block_hashes(tokens.data() + 16, 16, 8, all[1], nullptr, 0);
  CHECK(tail.size() == 2 && tail[0] == all[2] && tail[1] == all[3]);
  // Salt isolation.
  const std::uint8_t salt[] = {'t', '1'};
  const auto salted = kvtier::block_hashes(tokens.data(), tokens.size(), 8, root, salt, 2);
  for (std::size_t i = 0; i < all.size(); ++i) CHECK(salted[i] != all[i]);
  // A changed token changes its block and every later block, not earlier ones.
  tokens[20] += 1;
  const auto changed = kvtier::block_hashes(tokens.data(), tokens.size(), 8, root, nullptr, 0);
  CHECK(changed[0] == all[0] && changed[1] == all[1] && changed[2] != all[2] && changed[3] != all[3]);
  std::printf("block_hash: ok\n");
  return 0;
}
