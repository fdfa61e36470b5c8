// Paged MLA decode, q/out F16, cache F16 (one instantiation per file; see kvtier/mla_decode_kernel.h).
#include "kvtier/mla_decode_kernel.h"

namespace kvtier {
template void launch_mla_decode_typed<F16, F16>(const MlaDecodeParams& p, hipStream_t stream);
}  // namespace kvtier
