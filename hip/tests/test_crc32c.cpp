// CRC-32C against published check values and the portable loop: every length around the
// 8-byte words and the three-stream split, unaligned starts, and extending in pieces.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "check.h"
#include "crc32c.h"

namespace {

using kvtier::crc32c;
using kvtier::crc32c_extend;
using kvtier::crc32c_portable;

void test_known_values() {
  CHECK(crc32c("", 0) == 0);
  CHECK(crc32c("123456789", 9) == 0xE3069283u);
  CHECK(crc32c_portable(0, "123456789", 9) == 0xE3069283u);
  // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xFF, ascending and descending.
  std::uint8_t buf[32];
  std::memset(buf, 0, sizeof(buf));
  CHECK(crc32c(buf, 32) == 0x8A9136AAu);
  std::memset(buf, 0xFF, sizeof(buf));
  CHECK(crc32c(buf, 32) == 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<std::uint8_t>(i);
  CHECK(crc32c(buf, 32) == 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<std::uint8_t>(31 - i);
  CHECK(crc32c(buf, 32) == 0x113FDB5Cu);
}

std::vector<std::uint8_t> random_bytes(std::size_t n) {
  std::vector<std::uint8_t> v(n);
  std::uint32_t x = 2463534242u;
  for (auto& b : v) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    b = static_cast<std::uint8_t>(x);
  }
  return v;
}

void test_matches_portable() {
  const auto data = random_bytes((3 << 20) + 64);
  const std::size_t lens[] = {1,     7,     8,     9,      4095,   12287,   12288,   12289,
                              12295, 36863, 65537, 100003, 999999, 3 << 20, 4497408 % (3 << 20)};
  for (std::size_t off : {0, 1, 3, 8, 13}) {
    for (std::size_t len : lens) {
      const std::uint32_t want = crc32c_portable(0, data.data() + off, len);
      CHECK(crc32c(data.data() + off, len) == want);
      for (std::size_t cut : {std::size_t{0}, len / 3, len - 1, len}) {
        CHECK(crc32c_extend(crc32c(data.data() + off, cut), data.data() + off + cut, len - cut) == want);
        CHECK(crc32c_portable(crc32c_portable(0, data.data() + off, cut), data.data() + off + cut, len - cut) == want);
      }
    }
  }
}

void test_detects_flips() {
  auto data = random_bytes(1 << 20);
  const std::uint32_t clean = crc32c(data.data(), data.size());
  for (std::size_t pos : {std::size_t{0}, std::size_t{349524}, std::size_t{699049}, data.size() - 1}) {
    for (int bit = 0; bit < 8; ++bit) {
      data[pos] ^= static_cast<std::uint8_t>(1 << bit);
      CHECK(crc32c(data.data(), data.size()) != clean);
      data[pos] ^= static_cast<std::uint8_t>(1 << bit);
    }
  }
  CHECK(crc32c(data.data(), data.size()) == clean);
}

}  // namespace

int main() {
  std::printf("  crc32c hardware=%d\n", kvtier::crc32c_hardware() ? 1 : 0);
  test_known_values();
  test_matches_portable();
  test_detects_flips();
  std::printf("crc32c: ok\n");
  return 0;
}
