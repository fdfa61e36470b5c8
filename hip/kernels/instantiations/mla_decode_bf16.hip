// Paged MLA decode, q/out BF16, cache BF16 (one instantiation per file; see kvtier/mla_decode_kernel.h).
#include "kvtier/mla_decode_kernel.h"

namespace kvtier {
template void launch_mla_decode_typed<BF16, BF16>(const MlaDecodeParams& p, hipStream_t stream);
}  // namespace kvtier
