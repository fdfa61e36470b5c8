#!/usr/bin/env bash
# Run the GPU kernels of hip/kernels on the host under HIP-CPU, for both launch shapes (wave64 as
# on CDNA, warp32 as on NVIDIA), against their CPU implementations. A development check for
# machines without a GPU; not part of CI.
#
#   HIP_CPU=/path/to/HIP-CPU bash hip/tests/hip_cpu/run.sh
#
# Needs a checkout of ROCm's HIP-CPU (github.com/ROCm/HIP-CPU; header-only), g++ >= 10 and TBB
# (apt-get install libtbb-dev). Exit status 0 when every comparison passed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT"
: "${HIP_CPU:?set HIP_CPU to a HIP-CPU checkout}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
mapfile -t SOURCES < <(find hip/kernels -name '*.hip' | sort)
for warp in 64 32; do
  flags=(-std=c++17 -O1 -DKVTIER_HIP_CPU -DKVTIER_HIP_CPU_WARP_SIZE="$warp" -I"$HIP_CPU/include" -Ihip/include -w)
  mkdir -p "$OUT/$warp"
  for src in "${SOURCES[@]}"; do
    g++ "${flags[@]}" -x c++ -c "$src" -o "$OUT/$warp/$(basename "$src").o" &
  done
  wait
  g++ "${flags[@]}" hip/tests/hip_cpu/run_kernels.cpp hip/cpu/*.cpp "$OUT/$warp"/*.o -o "$OUT/run$warp" -ltbb -pthread
  echo "== warp size $warp"
  "$OUT/run$warp"
done
