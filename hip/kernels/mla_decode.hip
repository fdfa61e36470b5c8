// Paged MLA decode launcher: checks, then the instantiation of the (q, kv) dtype pair
// (hip/kernels/instantiations/mla_decode_<q>[_<kv>].hip).
#include <stdexcept>
#include <string>

#include "kvtier/compat.h"
#include "kvtier/mla_decode.h"
#include "kvtier/mla_decode_kernel.h"
#include "kvtier/numeric.h"

namespace kvtier {

// Compiled once each, in their own files.
extern template void launch_mla_decode_typed<F32, F32>(const MlaDecodeParams&, hipStream_t);
extern template void launch_mla_decode_typed<F16, F16>(const MlaDecodeParams&, hipStream_t);
extern template void launch_mla_decode_typed<BF16, BF16>(const MlaDecodeParams&, hipStream_t);
extern template void launch_mla_decode_typed<BF16, E4M3FN>(const MlaDecodeParams&, hipStream_t);
extern template void launch_mla_decode_typed<BF16, E4M3FNUZ>(const MlaDecodeParams&, hipStream_t);

int mla_decode_heads_per_block() { return kMlaHeadsPerBlock; }

void launch_mla_decode(const MlaDecodeParams& p, void* stream) {
  check_mla_decode_params(p);
  if (p.batch == 0 || p.num_heads == 0) return;
  if (p.batch > 65535 || p.num_heads > 65535)
    throw std::invalid_argument("mla_decode: batch and num_heads must be <= 65535 for one launch, got " +
                                std::to_string(p.batch) + " and " + std::to_string(p.num_heads));
  check_warp_size("mla_decode");
  hipStream_t s = static_cast<hipStream_t>(stream);
  visit_mla_dtypes(p.q_dtype, p.kv_dtype, [&](auto qt, auto kvt) {
    launch_mla_decode_typed<decltype(qt), decltype(kvt)>(p, s);
  });
}

}  // namespace kvtier
