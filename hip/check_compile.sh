#!/usr/bin/env bash
# Compile gate for the GPU kernels: every device source under hip/kernels/ (no GPU needed).
#
#   bash hip/check_compile.sh
#
# Targets:
#   - NVIDIA sm_90 with nvcc (-x cu, through hip/include/kvtier/compat.h): host and device code,
#     host warnings as errors, ptxas warnings (register spills included) as errors;
#   - AMD gfx942 and gfx90a (CDNA, wave64) with Debian's clang-19 and the HIP headers of Debian's
#     libamdhip64-dev: device code to ISA (-nogpulib: no ROCm device libraries, math calls stay
#     external), failing on any VGPR spill or scratch (private segment) use; SGPR spills, which
#     go to VGPR lanes, are reported, not failed; then the host side (launch stubs) with the same
#     headers. gfx950 needs LLVM 20 and is not checked here.
# Missing AMD tools are installed with apt-get (as root; ~20 s on a fresh Debian 12 machine);
# nvcc must be present (the CUDA toolkit, e.g. /usr/local/cuda/bin). Also fails when a .hip file
# is missing from CMakeLists.txt's source list. Prints one line per (source, target) with the
# register, spill and shared-memory counts of its kernels. Exit status: 0 when all compiled.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CLANG="${CLANG:-clang-19}"
AMD_ARCHS=(gfx942 gfx90a)
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
mapfile -t SOURCES < <(find hip/kernels -name '*.hip' | sort)
[ "${#SOURCES[@]}" -gt 0 ] || { echo "check_compile: no .hip sources under hip/kernels" >&2; exit 1; }

for src in "${SOURCES[@]}"; do
  grep -qF "$src" CMakeLists.txt || { echo "check_compile: $src is not listed in CMakeLists.txt" >&2; exit 1; }
done

install_amd_tools() {
  local need=()
  command -v "$CLANG" >/dev/null || need+=(clang-19)
  [ -f /usr/include/hip/hip_runtime.h ] || need+=(libamdhip64-dev)
  [ "${#need[@]}" -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "check_compile: missing ${need[*]}; run as root or install them (apt-get install ${need[*]})" >&2
    return 1
  fi
  local t0=$SECONDS
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${need[@]}" >"$OUT/apt.log" 2>&1 || {
    apt-get update -qq >>"$OUT/apt.log" 2>&1 && apt-get install -y -qq --no-install-recommends "${need[@]}" >>"$OUT/apt.log" 2>&1
  } || { tail -n 20 "$OUT/apt.log" >&2; return 1; }
  echo "installed ${need[*]} in $((SECONDS - t0)) s"
}

NVCC="$(command -v nvcc || true)"
[ -n "$NVCC" ] || { [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc; }
[ -n "$NVCC" ] || { echo "check_compile: nvcc not found (install the CUDA toolkit, >= 12)" >&2; exit 1; }
install_amd_tools

# Each (source, target) job writes its report to $OUT/jobs/<n>.txt and, on failure, $OUT/jobs/<n>.failed.
mkdir -p "$OUT/jobs"
report() { printf '%-56s %-7s %s\n' "$1" "$2" "$3" >>"$JOB.txt"; }
fail() { report "$1" "$2" "FAILED"; sed 's/^/    | /' "$3" | head -n 40 >>"$JOB.txt"; touch "$JOB.failed"; }

# nvcc, sm_90: "Used N registers ... spill ..." per kernel from ptxas -v.
nvcc_one() {
  local src=$1 log="$JOB.log"
  if "$NVCC" -std=c++17 -arch=sm_90 -O3 -x cu -Ihip/include -Werror all-warnings \
      -Xcompiler -Wall,-Wextra,-Werror -Xptxas -v,-warn-spills,-Werror -c "$src" -o "$JOB.o" >"$log" 2>&1; then
    local usage
    usage=$(awk '/Used [0-9]+ registers/ {r = 0; m = 0; for (i = 1; i < NF; i++) {
                   if ($(i + 1) ~ /^registers/) r = $i; if ($(i + 1) == "bytes" && $(i + 2) == "smem") m = $i }
                   k = k " " r "/" m}
                 END {print (k == "" ? "(no kernels)" : "registers/smem bytes" k)}' "$log")
    report "$src" sm_90 "$usage"
  else
    fail "$src" sm_90 "$log"
  fi
}

# clang -x hip: device ISA (registers and spills from the kernel metadata), then the host side.
amd_one() {
  local src=$1 arch=$2 log="$JOB.log" asm="$JOB.s"
  local flags=(-std=c++17 -x hip --offload-arch="$arch" -nogpulib -O3 -Wall -Wextra -Werror -Ihip/include)
  if ! "$CLANG" "${flags[@]}" --offload-device-only -S "$src" -o "$asm" >"$log" 2>&1 ||
     ! "$CLANG" "${flags[@]}" --offload-host-only -c "$src" -o "$JOB.o" >>"$log" 2>&1; then
    fail "$src" "$arch" "$log"
    return
  fi
  local spills usage
  spills=$(awk '/\.vgpr_spill_count:/ {s += $2} /amdhsa_private_segment_fixed_size/ {s += $2} END {print s + 0}' "$asm")
  usage=$(awk '/\.group_segment_fixed_size:/ {g = $2} /\.sgpr_spill_count:/ {p = $2}
               /\.vgpr_count:/ {k = k " " $2 "/" p "/" g}
               END {print (k == "" ? "(no kernels)" : "VGPRs/SGPR spills/LDS bytes" k)}' "$asm")
  if [ "$spills" -ne 0 ]; then
    { echo "VGPR spills / scratch bytes: $spills"; echo "$usage"; } >"$log"
    fail "$src" "$arch" "$log"
  else
    report "$src" "$arch" "$usage"
  fi
}

t0=$SECONDS
n=0
for src in "${SOURCES[@]}"; do
  for target in sm_90 "${AMD_ARCHS[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do wait -n || true; done
    n=$((n + 1))
    JOB="$OUT/jobs/$(printf '%03d' $n)"
    if [ "$target" = sm_90 ]; then nvcc_one "$src" & else amd_one "$src" "$target" & fi
  done
done
wait
cat "$OUT"/jobs/*.txt
status=0
compgen -G "$OUT/jobs/*.failed" >/dev/null && status=1
echo "check_compile: ${#SOURCES[@]} sources x (sm_90 + ${AMD_ARCHS[*]}) in $((SECONDS - t0)) s: $([ $status -eq 0 ] && echo ok || echo FAILED)"
exit $status
