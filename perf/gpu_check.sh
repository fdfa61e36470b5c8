#!/usr/bin/env bash
# The GPU check: one script for a GPU machine without network access.
#
#   bash perf/gpu_check.sh            # writes to $OUT, or perf/results/ when OUT is unset
#   bash perf/gpu_check.sh --dry-run  # any machine: every step, benchmarks at tiny CPU shapes
#
# Uses the python3 found there (PYTHON=... to choose another) with its preinstalled torch and
# triton; installs nothing. Steps, each with a time limit so the whole run stays under 8 minutes
# on an H200 (GPU_CHECK_BUDGET_S, default 450 s, is shared by the steps; a benchmark that runs out
# of its share skips its largest remaining shapes and prints them):
#   1. environment: torch, triton, the device; stops here without a GPU;
#   2. build in place, offline (needs setuptools, pybind11 and cmake there): first the native
#      extension kvtier._C (`KVTIER_BUILD_HIP=off setup.py build_ext --inplace`); if that fails the
#      Triton kernels and benchmarks run without it (kvtier.ops does not need it), and the output
#      says so; then the GPU kernels kvtier._hip (`KVTIER_BUILD_HIP=auto`: built when nvcc, or
#      hipcc on ROCm, is found with the GPU driver). No GPU compiler: the hip backend is reported
#      unavailable and its tests skip with the reason; a compiler that fails is a FAILED check;
#   3. the GPU tests: `pytest tests/ops -m gpu` (compiled Triton kernels and the HIP kernels vs the
#      torch references at K2 widths, HIP vs its C++ CPU implementation; the interpreter sweeps of
#      tests/ops are CPU-only and skip themselves on a GPU; the vLLM connector's MLA blocks
#      [num_blocks, block_size, 576] bf16 on CUDA through host, disk and remote tiers);
#   4. benchmarks at K2 shapes: perf/bench_mla.py (decode batch 1-128 at 4K-128K, bf16 and fp8 KV,
#      extend; triton, hip and aiter (where available) vs the torch reference; % of the measured
#      copy bandwidth) and perf/bench_moe.py (MoE at 1-4096 tokens, E=384, top-8, H=7168, I=2048,
#      bf16, INT4 group-32 and FP8-block weights with % of HBM and matrix peak; moe_align_block_size
#      and the page gather on torch, triton and hip), then perf/bench_linear.py (FP8-block and INT4
#      linears at K2 projection shapes vs the bf16 vendor GEMM; LINEAR_S, default 40 s), then
#      perf/bench_kda.py (K3's KDA: prefill tokens/s from a given state, decode step time at batch
#      1-128 with % of HBM peak, the short conv; triton vs the torch reference; KDA_S, default 40 s);
#   4b. perf/bench_decode_graph.py: decode step time eager vs replayed from a CUDA/HIP graph, batch
#      1-64 (tiny model; 90 s at most);
#   5. serving on the GPU preset k2-gpu (K2's layers at one-GPU size; kvtier.model.config): the
#      built-in workload, `kvtier bench --device cuda` for device-only and tiered (p99 TTFT,
#      throughput, hit rates per tier), then perf/bench_copy_path.py: the device copy path's
#      bandwidth vs the pinned host<->device bandwidth measured in the same run. SERVING_S (default
#      200 s) of the budget is kept for this step; the kernel benchmarks share the rest. A bench
#      that runs out of its time is killed and reported as skipped;
#   6. a summary: gpu_check_summary.md (decode/extend table with % of measured HBM bandwidth).
# --dry-run skips the build (it uses the installed kvtier) and runs steps 3-6 at CPU sizes (tiny
# preset on the CPU, CPU streams), so CI checks every command line of the script; its budget and
# step limits are 4x (a CPU is slower than the GPU it stands for).
# Files: gpu_check.log, gpu_check_build.log, gpu_check_build_hip.log, gpu_check_pytest.log, bench_mla.csv, bench_moe.csv,
# bench_linear.csv, bench_kda.csv, bench_kda.md, bench_decode_graph.csv, bench_serving.json, bench_serving.log,
# bench_copy_path.csv, serving_summary.md, gpu_check_summary.md. Exit status: 0 when every step ran and passed, else 1.
set -uo pipefail
DRY=""
[ "${1:-}" = "--dry-run" ] && DRY="--dry-run"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DEST="${OUT:-$ROOT/perf/results}"
mkdir -p "$DEST"
exec > >(tee "$DEST/gpu_check.log") 2>&1
# A dry run on a shared CPU is several times slower than the GPU run it stands for: it gets a
# larger budget and longer step limits (SLOW), so that it checks the commands, not the CPU's speed.
SLOW=1
[ -n "$DRY" ] && SLOW=4
BUDGET="${GPU_CHECK_BUDGET_S:-$((450 * SLOW))}"
SERVING_S="${SERVING_S:-200}"
LINEAR_S="${LINEAR_S:-$((40 * SLOW))}"
KDA_S="${KDA_S:-$((40 * SLOW))}"
T0=$SECONDS
status=0
left() { echo $((BUDGET - (SECONDS - T0))); }
step() { echo; echo "== $1 (t=$((SECONDS - T0)) s, $(left) s left)"; }

step "environment"
if ! DRY="$DRY" "$PY" - <<'EOF'
import os, sys, torch
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "not installed"
gpu = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}, hip {torch.version.hip}), "
      f"triton {tv}")
print(f"device: {torch.cuda.get_device_name(0) if gpu else 'none'}")
sys.exit(0 if (gpu or os.environ["DRY"]) and tv != "not installed" else 1)
EOF
then
  echo "gpu_check: needs a CUDA/ROCm GPU and triton; stopping"
  exit 1
fi

step "build in place (offline)"
NATIVE="built"
HIP_BUILD="built"
if [ -n "$DRY" ]; then
  NATIVE="not rebuilt (--dry-run)"; HIP_BUILD="not rebuilt (--dry-run)"
  echo "--dry-run: no build; the installed kvtier is used"
elif ! KVTIER_BUILD_HIP=off timeout 180 "$PY" setup.py build_ext --inplace >"$DEST/gpu_check_build.log" 2>&1; then
  NATIVE="NOT built"
  echo "native extension kvtier._C NOT built (last lines of gpu_check_build.log below); the kernel tests"
  echo "and benchmarks run without it (kvtier.ops does not import it)"
  tail -n 5 "$DEST/gpu_check_build.log" | sed 's/^/  | /'
else
  echo "native extension kvtier._C built in place"
fi
if [ -n "$DRY" ]; then
  :
elif ! KVTIER_BUILD_HIP=auto timeout 240 "$PY" setup.py build_ext --inplace >"$DEST/gpu_check_build_hip.log" 2>&1; then
  HIP_BUILD="FAILED (gpu_check_build_hip.log)"
  status=1
  tail -n 15 "$DEST/gpu_check_build_hip.log" | sed 's/^/  | /'
elif grep -q "kvtier._hip is not built" "$DEST/gpu_check_build_hip.log"; then
  HIP_BUILD="NOT built ($(grep -m1 "kvtier._hip is not built" "$DEST/gpu_check_build_hip.log" | cut -d: -f2- | sed "s/^ //"))"
fi
echo "GPU kernels kvtier._hip: $HIP_BUILD"
# The source tree as a package: python/kvtier plus triton_kernels/ as kvtier.triton_kernels (the
# mapping setup.py makes), assembled from symlinks in a temporary directory.
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
cp -rs "$ROOT/python/kvtier" "$SRC/kvtier"
ln -sfn "$ROOT/triton_kernels" "$SRC/kvtier/triton_kernels"  # -n: replace the copied link, not write into it
export PYTHONPATH="$SRC:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import kvtier.ops, kvtier.triton_kernels; print('kvtier from', kvtier.__file__)" || status=1

step "GPU tests (pytest -m gpu)"
timeout $((200 * SLOW)) "$PY" -m pytest tests/ops tests/serve/test_cuda_graph.py tests/cache/test_device_copy.py \
  tests/cache/test_device_copy_e2e.py tests/bench/test_device_option.py tests/integrations/test_vllm_mla.py \
  -m gpu -q -p no:cacheprovider \
  >"$DEST/gpu_check_pytest.log" 2>&1
rc=$?
tail -n 15 "$DEST/gpu_check_pytest.log"
if [ $rc -ne 0 ]; then
  echo "GPU tests: FAILED (exit $rc; 124 = time limit)"
  status=1
fi

step "decode step, eager vs CUDA/HIP graph (batch 1-64)"
timeout $((90 * SLOW)) "$PY" perf/bench_decode_graph.py $DRY --repeats 10 --csv "$DEST/bench_decode_graph.csv" \
  || { echo "bench_decode_graph.py failed (exit $?; 124 = time limit)"; status=1; }

step "MLA benchmarks"
share=$(( ($(left) - 20 - SERVING_S) * 11 / 20 ))  # ~55% of what is left; MoE, serving, the summary the rest
if [ "$share" -gt 30 ]; then
  timeout $((share + 60)) "$PY" perf/bench_mla.py $DRY --budget-s "$share" --repeats 10 --csv "$DEST/bench_mla.csv" \
    --summary "$DEST/gpu_check_summary.md" >/dev/null || { echo "bench_mla.py failed"; status=1; }
else
  echo "no time left for the MLA benchmarks"; status=1
fi

step "MoE benchmarks"
share=$(( $(left) - 30 - SERVING_S - LINEAR_S - KDA_S ))
if [ "$share" -gt 20 ]; then
  timeout $((share + 20)) "$PY" perf/bench_moe.py $DRY --budget-s "$share" --repeats 5 --csv "$DEST/bench_moe.csv" \
    || { echo "bench_moe.py failed"; status=1; }
else
  echo "no time left for the MoE benchmarks"; status=1
fi

step "quantized linear benchmarks (FP8 block, INT4 group)"
share=$(( $(left) - 20 - SERVING_S ))
[ "$share" -gt "$LINEAR_S" ] && share=$LINEAR_S
if [ "$share" -gt 15 ]; then
  timeout $((share + 20)) "$PY" perf/bench_linear.py $DRY --budget-s "$share" --repeats 5 \
    --csv "$DEST/bench_linear.csv" || { echo "bench_linear.py failed"; status=1; }
else
  echo "no time left for the linear benchmarks"; status=1
fi

step "KDA benchmarks (prefill, decode, short conv)"
share=$(( $(left) - 20 - SERVING_S ))
[ "$share" -gt "$KDA_S" ] && share=$KDA_S
if [ "$share" -gt 15 ]; then
  timeout $((share + 20)) "$PY" perf/bench_kda.py $DRY --budget-s "$share" --repeats 5 --csv "$DEST/bench_kda.csv" \
    --summary "$DEST/bench_kda.md" || { echo "bench_kda.py failed"; status=1; }
else
  echo "no time left for the KDA benchmarks"; status=1
fi

step "serving on the GPU preset: device-only vs tiered; copy path vs pinned bandwidth"
if [ -n "$DRY" ]; then
  SERVE_ARGS=(--device cpu --model tiny --sessions 2 --concurrency 2 --max-turns 2 --token-scale 0.015625)
  COPY_ARGS=(--dry-run)
else
  SERVE_ARGS=(--device cuda --model k2-gpu --sessions 8 --concurrency 4 --max-turns 4 --token-scale 0.0625
              --max-num-batched-tokens 4096 --ramp-s 2 --threads 8)
  COPY_ARGS=(--device cuda --model k2-gpu --page-size 16 --blocks 512 --mib 256 --repeats 5)
fi
share=$(( $(left) - 45 ))
rm -f "$DEST/bench_serving.json"
if [ "$share" -gt 30 ]; then
  timeout "$share" "$PY" -m kvtier.cli bench "${SERVE_ARGS[@]}" --configs device-only,tiered \
    --json "$DEST/bench_serving.json" --plot "" >"$DEST/bench_serving.log" 2>&1
  rc=$?
  tail -n 12 "$DEST/bench_serving.log"
  if [ $rc -eq 124 ]; then
    echo "serving bench: SKIPPED, it did not finish in its $share s (bench_serving.log has what ran)"
  elif [ $rc -ne 0 ]; then
    echo "serving bench: FAILED (exit $rc)"; status=1
  fi
else
  echo "serving bench: SKIPPED, only $share s left"
fi
BENCH_JSON=()
[ -f "$DEST/bench_serving.json" ] && BENCH_JSON=(--bench-json "$DEST/bench_serving.json")
timeout $((60 * SLOW)) "$PY" perf/bench_copy_path.py "${COPY_ARGS[@]}" "${BENCH_JSON[@]}" --csv "$DEST/bench_copy_path.csv" \
  --summary "$DEST/serving_summary.md" >/dev/null || { echo "bench_copy_path.py failed (exit $?)"; status=1; }

step "summary"
{
  echo "# GPU check"
  echo
  echo "native extension: $NATIVE; GPU kernels kvtier._hip: $HIP_BUILD; total $((SECONDS - T0)) s; status" \
    "$([ $status -eq 0 ] && echo ok || echo FAILED)"
  echo
  [ -f "$DEST/gpu_check_summary.md" ] && cat "$DEST/gpu_check_summary.md"
  if [ -f "$DEST/serving_summary.md" ]; then
    echo
    cat "$DEST/serving_summary.md"
  fi
  if [ -f "$DEST/bench_moe.csv" ]; then
    echo
    echo "MoE, moe_align_block_size, sampling, page gather (op, shape, backend, median µs, GB/s, TFLOP/s, % HBM peak,"
    echo "% matrix peak):"
    echo
    cut -d, -f1,2,4,7,10,11,12,13 "$DEST/bench_moe.csv" | sed 's/^/    /'
  fi
  if [ -f "$DEST/bench_linear.csv" ]; then
    echo
    echo "Quantized linears (op, shape, backend, median µs, GB/s, TFLOP/s, % HBM peak, % matrix peak):"
    echo
    cut -d, -f1,2,4,7,10,11,12,13 "$DEST/bench_linear.csv" | sed 's/^/    /'
  fi
  if [ -f "$DEST/bench_kda.md" ]; then
    echo
    cat "$DEST/bench_kda.md"
  fi
  if [ -f "$DEST/bench_decode_graph.csv" ]; then
    echo
    echo "Decode step, eager vs graph replay (model, batch, context, eager ms, graph ms, eager/graph):"
    echo
    cut -d, -f1-6 "$DEST/bench_decode_graph.csv" | sed 's/^/    /'
  fi
} >"$DEST/gpu_check_summary.tmp" && mv "$DEST/gpu_check_summary.tmp" "$DEST/gpu_check_summary.md"
cat "$DEST/gpu_check_summary.md"
exit $status
