#include "crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVTIER_CRC32C_X86 1
#include <nmmintrin.h>
#endif

namespace kvtier {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// Slice-by-8 tables: kTable[k][b] is the CRC register after byte b followed by k zero bytes.
using Tables = std::array<std::array<std::uint32_t, 256>, 8>;
Tables make_tables() {
  Tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  return t;
}
const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

// Register update (no pre/post inversion) by the portable loop.
std::uint32_t update_portable(std::uint32_t crc, const std::uint8_t* p, std::size_t len) {
  const Tables& t = tables();
  for (; len > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7) != 0; --len) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  for (; len >= 8; len -= 8, p += 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;  // little-endian: the register meets the first four bytes
    crc = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
          t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
  }
  for (; len > 0; --len) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

// ---- shifting a register over zero bytes (to join independently computed streams) ----------
// Polynomials mod P in the reflected representation: bit 31 is x^0. As in zlib's crc32_combine.

std::uint32_t multmodp(std::uint32_t a, std::uint32_t b) {
  std::uint32_t m = 1u << 31, p = 0;
  while (a != 0) {
    if (a & m) {
      p ^= b;
      a &= ~m;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) mod P for k in [0, 64).
std::array<std::uint32_t, 64> make_x2n() {
  std::array<std::uint32_t, 64> t{};
  std::uint32_t p = 1u << 30;  // x^1
  for (auto& e : t) {
    e = p;
    p = multmodp(p, p);
  }
  return t;
}

// The register after `crc` is followed by `len` zero bytes: crc * x^(8 len) mod P.
std::uint32_t shift_zeros(std::uint32_t crc, std::uint64_t len) {
  static const std::array<std::uint32_t, 64> x2n = make_x2n();
  std::uint32_t p = 1u << 31;  // x^0
  for (unsigned k = 3; len != 0; len >>= 1, ++k)
    if (len & 1) p = multmodp(x2n[k & 63], p);
  return multmodp(p, crc);
}

#ifdef KVTIER_CRC32C_X86
__attribute__((target("sse4.2"))) std::uint32_t update_sse42_serial(std::uint32_t crc, const std::uint8_t* p,
                                                                   std::size_t len) {
  std::uint64_t c = crc;
  for (; len >= 8; len -= 8, p += 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; len > 0; --len) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

// Three streams hide the instruction's 3-cycle latency; long inputs only (joining costs ~1 us).
__attribute__((target("sse4.2"))) std::uint32_t update_sse42(std::uint32_t crc, const std::uint8_t* p,
                                                            std::size_t len) {
  constexpr std::size_t kMin = 3 * 4096;
  if (len < kMin) return update_sse42_serial(crc, p, len);
  const std::size_t lane = len / 3 / 8 * 8;
  const std::uint8_t* a = p;
  const std::uint8_t* b = p + lane;
  const std::uint8_t* c = p + 2 * lane;
  std::uint64_t ca = crc, cb = 0, cc = 0;
  for (std::size_t i = 0; i < lane; i += 8) {
    std::uint64_t wa, wb, wc;
    std::memcpy(&wa, a + i, 8);
    std::memcpy(&wb, b + i, 8);
    std::memcpy(&wc, c + i, 8);
    ca = _mm_crc32_u64(ca, wa);
    cb = _mm_crc32_u64(cb, wb);
    cc = _mm_crc32_u64(cc, wc);
  }
  // Linearity: reg(init, A||B) = reg(init, A) * x^(8|B|) ^ reg(0, B).
  std::uint32_t r = shift_zeros(static_cast<std::uint32_t>(ca), lane) ^ static_cast<std::uint32_t>(cb);
  r = shift_zeros(r, lane) ^ static_cast<std::uint32_t>(cc);
  return update_sse42_serial(r, p + 3 * lane, len - 3 * lane);
}

bool detect_sse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}
#endif

}  // namespace

bool crc32c_hardware() {
#ifdef KVTIER_CRC32C_X86
  static const bool hw = detect_sse42();
  return hw;
#else
  return false;
#endif
}

std::uint32_t crc32c_portable(std::uint32_t crc, const void* data, std::size_t len) {
  return ~update_portable(~crc, static_cast<const std::uint8_t*>(data), len);
}

std::uint32_t crc32c_extend(std::uint32_t crc, const void* data, std::size_t len) {
  const auto* p = static_cast<const std::uint8_t*>(data);
#ifdef KVTIER_CRC32C_X86
  if (crc32c_hardware()) return ~update_sse42(~crc, p, len);
#endif
  return ~update_portable(~crc, p, len);
}

std::uint32_t crc32c(const void* data, std::size_t len) { return crc32c_extend(0, data, len); }

}  // namespace kvtier
