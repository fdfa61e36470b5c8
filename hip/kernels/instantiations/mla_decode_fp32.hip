// Paged MLA decode, q/out F32, cache F32 (one instantiation per file; see kvtier/mla_decode_kernel.h).
#include "kvtier/mla_decode_kernel.h"

namespace kvtier {
template void launch_mla_decode_typed<F32, F32>(const MlaDecodeParams& p, hipStream_t stream);
}  // namespace kvtier
