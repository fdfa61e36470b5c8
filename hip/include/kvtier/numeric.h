// Element types of the kernels as plain bits, with exact conversions that run on the host and on
// both GPU vendors (no vendor half/bfloat16 types: the same code and results everywhere).
//
// Each type tag has `storage` (the bits as stored in memory), `to_float` (exact) and, for the
// output types, `from_float` (round to nearest even, NaN kept, overflow to inf as torch does).
// fp8 formats (OCP e4m3fn: bias 7, NaN = S.1111.111, no inf; e4m3fnuz: bias 8, NaN = 0x80, no
// inf or -0) from the OCP 8-bit floating point specification and LLVM's APFloat semantics.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvtier/compat.h"

namespace kvtier {

// Codes shared with Python (kvtier.ops._native.DTYPE_CODES).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3FN = 3, kFloat8E4M3FNUZ = 4 };

template <typename To, typename From>
KVTIER_HD inline To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To out;
  memcpy(&out, &v, sizeof(To));
  return out;
}

struct F32 {
  using storage = float;
  static constexpr DType dtype = DType::kFloat32;
  KVTIER_HD static float to_float(storage v) { return v; }
  KVTIER_HD static storage from_float(float v) { return v; }
};

struct BF16 {
  using storage = std::uint16_t;
  static constexpr DType dtype = DType::kBFloat16;
  KVTIER_HD static float to_float(storage v) { return bit_cast<float>(static_cast<std::uint32_t>(v) << 16); }
  KVTIER_HD static storage from_float(float v) {
    if (v != v) return 0x7FC0;  // canonical NaN, as torch
    const std::uint32_t u = bit_cast<std::uint32_t>(v);
    return static_cast<storage>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

struct F16 {
  using storage = std::uint16_t;
  static constexpr DType dtype = DType::kFloat16;
  KVTIER_HD static float to_float(storage h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1Fu;
    const std::uint32_t man = h & 0x3FFu;
    if (exp == 0x1F) return bit_cast<float>(sign | 0x7F800000u | (man << 13));  // inf / NaN
    if (exp != 0) return bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
    const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;  // 2**-24, exact
    return sign ? -mag : mag;
  }
  KVTIER_HD static storage from_float(float v) {
    const std::uint32_t u = bit_cast<std::uint32_t>(v);
    const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u;            // NaN
    if (a >= 0x477FF000u) return sign | 0x7C00u;           // rounds to >= 65520: inf
    if (a >= 0x38800000u) {                                // normal half (>= 2**-14)
      const std::uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
      return sign | static_cast<std::uint16_t>(r >> 13);
    }
    if (a < 0x33000000u) return sign;                      // < 2**-25: rounds to 0
    // subnormal half: value = a_float * 2**24 rounded to an integer (ties to even)
    const std::uint32_t exp = a >> 23, man = (a & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;                // 14..24 bits dropped
    std::uint32_t q = man >> shift;
    const std::uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<std::uint16_t>(q);
  }
};

struct E4M3FN {
  using storage = std::uint8_t;
  static constexpr DType dtype = DType::kFloat8E4M3FN;
  KVTIER_HD static float to_float(storage b) {
    const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
    const std::uint32_t exp = (b >> 3) & 0xFu, man = b & 0x7u;
    if (exp == 0xF && man == 0x7) return bit_cast<float>(sign | 0x7FC00000u);
    if (exp != 0) return bit_cast<float>(sign | ((exp + 120u) << 23) | (man << 20));
    const float mag = static_cast<float>(man) * 0.001953125f;  // 2**-9
    return sign ? -mag : mag;
  }
};

struct E4M3FNUZ {
  using storage = std::uint8_t;
  static constexpr DType dtype = DType::kFloat8E4M3FNUZ;
  KVTIER_HD static float to_float(storage b) {
    if (b == 0x80u) return bit_cast<float>(0x7FC00000u);
    const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
    const std::uint32_t exp = (b >> 3) & 0xFu, man = b & 0x7u;
    if (exp != 0) return bit_cast<float>(sign | ((exp + 119u) << 23) | (man << 20));
    const float mag = static_cast<float>(man) * 0.0009765625f;  // 2**-10
    return sign ? -mag : mag;
  }
};

// Bytes per element of a DType code (0 for an unknown code).
KVTIER_HD inline int dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E4M3FNUZ: return 1;
  }
  return 0;
}

}  // namespace kvtier
