// Host test of the token buffer: its hashes always equal block_hashes() computed from scratch
// over its ids, through appends, truncates and re-appends, for page_size 1/16/64, with an empty
// and a non-empty salt.
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

#include "block_hash.h"
#include "check.h"
#include "token_buffer.h"

namespace {

using kvtier::TokenBuffer;

// From-scratch hashes of the buffer's ids (the reference).
std::vector<kvtier::BlockHash> scratch(const TokenBuffer& buf) {
  std::vector<std::int64_t> wide(buf.ids(), buf.ids() + buf.size());
  return kvtier::block_hashes(wide.data(), wide.size(), buf.page_size(), kvtier::block_hash_root(),
                              buf.salt().data(), buf.salt().size());
}

bool matches(const TokenBuffer& buf) {
  const auto ref = scratch(buf);
  return buf.num_blocks() == buf.size() / buf.page_size() && buf.hashes() == ref &&
         buf.last_hash() == (ref.empty() ? kvtier::block_hash_root() : ref.back());
}

std::vector<std::uint32_t> random_ids(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::uint32_t> out(n);
  for (auto& t : out) t = static_cast<std::uint32_t>(rng());  // full 32-bit range
  return out;
}

void test_append_truncate_reappend(std::size_t page_size, const std::vector<std::uint8_t>& salt) {
  std::mt19937_64 rng(page_size * 131 + salt.size());
  TokenBuffer buf(page_size, salt.data(), salt.size());
  CHECK(buf.size() == 0 && buf.num_blocks() == 0 && buf.last_hash() == kvtier::block_hash_root());
  const auto turn1 = random_ids(rng, 5 * page_size + page_size / 2);
  buf.append(turn1.data(), turn1.size());
  CHECK(matches(buf) && buf.num_blocks() == 5);
  const auto before = buf.hashes();
  // Roll back into the middle of page 2, then re-append the same ids: the same hashes.
  const std::size_t cut = 2 * page_size + page_size / 3;
  buf.truncate(cut);
  CHECK(buf.size() == cut && matches(buf));
  buf.append(turn1.data() + cut, turn1.size() - cut);
  CHECK(buf.hashes() == before);
  // Re-append different ids after the cut: the pages before the cut keep their hashes.
  buf.truncate(cut);
  auto other = random_ids(rng, 4 * page_size);
  buf.append(other.data(), other.size());
  CHECK(matches(buf));
  for (std::size_t b = 0; b < cut / page_size; ++b) CHECK(buf.hashes()[b] == before[b]);
  // Appending one id at a time equals one bulk append.
  TokenBuffer one(page_size, salt.data(), salt.size());
  for (std::size_t i = 0; i < buf.size(); ++i) one.append(buf.ids() + i, 1);
  CHECK(one.hashes() == buf.hashes());
  // Edge cases: empty append, truncate to size, truncate to 0, out of range.
  buf.append(nullptr, 0);
  buf.truncate(buf.size());
  CHECK(matches(buf));
  bool threw = false;
  try {
    buf.truncate(buf.size() + 1);
  } catch (const std::out_of_range&) {
    threw = true;
  }
  CHECK(threw && matches(buf));
  buf.truncate(0);
  CHECK(buf.size() == 0 && buf.num_blocks() == 0 && matches(buf));
}

void test_random_ops(std::size_t page_size, const std::vector<std::uint8_t>& salt) {
  std::mt19937_64 rng(7 + page_size + 1000 * salt.size());
  TokenBuffer buf(page_size, salt.data(), salt.size());
  std::vector<std::uint32_t> model;  // the ids the buffer should hold
  for (int step = 0; step < 300; ++step) {
    if (rng() % 3 == 0 && !model.empty()) {
      const std::size_t n = rng() % (model.size() + 1);
      buf.truncate(n);
      model.resize(n);
    } else {
      const auto ids = random_ids(rng, rng() % (3 * page_size + 2));
      buf.append(ids.data(), ids.size());
      model.insert(model.end(), ids.begin(), ids.end());
    }
    CHECK(buf.size() == model.size());
    CHECK(std::vector<std::uint32_t>(buf.ids(), buf.ids() + buf.size()) == model);
    CHECK(matches(buf));
  }
}

void test_salt_isolation() {
  const std::vector<std::uint8_t> salt = {'t', '1'};
  std::vector<std::uint32_t> ids(64);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::uint32_t>(i * 7919 % 163840);
  TokenBuffer plain(16, nullptr, 0), salted(16, salt.data(), salt.size());
  plain.append(ids.data(), ids.size());
  salted.append(ids.data(), ids.size());
  for (std::size_t b = 0; b < 4; ++b) CHECK(plain.hashes()[b] != salted.hashes()[b]);
}

void test_capacity() {
  TokenBuffer buf(16, nullptr, 0);
  buf.reserve(1000);
  const std::uint32_t* p = buf.ids();
  std::vector<std::uint32_t> ids(1000, 5);
  buf.append(ids.data(), 600);
  buf.truncate(10);  // never reallocates
  buf.append(ids.data(), 990);
  CHECK(buf.ids() == p && buf.capacity() >= 1000 && matches(buf));
  bool threw = false;
  try {
    TokenBuffer bad(0, nullptr, 0);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

}  // namespace

int main() {
  const std::vector<std::vector<std::uint8_t>> salts = {{}, {'t', 'e', 'n', 'a', 'n', 't', 0, 0xff}};
  for (std::size_t page_size : {1, 16, 64}) {
    for (const auto& salt : salts) {
      test_append_truncate_reappend(page_size, salt);
      test_random_ops(page_size, salt);
    }
  }
  test_salt_isolation();
  test_capacity();
  std::printf("token_buffer: ok\n");
  return 0;
}
