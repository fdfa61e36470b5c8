// CRC-32C (Castagnoli: polynomial 0x1EDC6F41, reflected 0x82F63B78, init and final xor
// 0xFFFFFFFF; the checksum of iSCSI, ext4 metadata and SSE4.2's crc32 instruction).
//
// x86-64 with SSE4.2: the crc32 instruction on three interleaved streams (~8 bytes/cycle, about
// 20 GB/s), chosen at run time. Elsewhere: a portable table-driven loop (slice-by-8, ~1-2 GB/s)
// that returns the same values. CRC32C("123456789") = 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

// CRC-32C of data[0, len). crc32c(b, n) == crc32c_extend(crc32c(a, m), b, n) for the checksum
// of the concatenation a||b.
std::uint32_t crc32c(const void* data, std::size_t len);
std::uint32_t crc32c_extend(std::uint32_t crc, const void* data, std::size_t len);

// The same checksums by the portable loop only (for tests of the hardware path).
std::uint32_t crc32c_portable(std::uint32_t crc, const void* data, std::size_t len);

// True when crc32c() uses the SSE4.2 instruction.
bool crc32c_hardware();

}  // namespace kvtier
