#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the C++ host tests (ctest; also an ASan+UBSan build), the
# HIP compile gate (every hip/kernels source for sm_90 with nvcc and for gfx942/gfx90a with
# clang-19, installing the AMD tools when missing), the Triton compile gate (every kernel at K2
# shapes for gfx950, gfx942 and sm_90; no GPU needed) and the Python tests (pytest, one worker per
# core with pytest-xdist; KVTIER_TEST_WORKERS=0 for one process).
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
. scripts/setup.sh
# The newest official anthropic and openai clients, whatever the venv had: a field they start
# sending back fails tests/serve/api/test_sdk_fields.py here, not a user's request.
python -m pip install -q -U anthropic openai 2>&1 | quiet
# vLLM for the connector's end-to-end test installs in the background while the C++ tests and the
# compile gates run (KVTIER_WITH_VLLM=0 skips it; the test then skips, saying why).
vllm_pid=""
if [ "${KVTIER_WITH_VLLM:-1}" = 1 ]; then
  mkdir -p build
  bash scripts/setup_vllm.sh >build/vllm-install.log 2>&1 &
  vllm_pid=$!
fi
# The AgentX harness for the bounded trace replay, likewise (KVTIER_WITH_AGENTX=0 skips it).
agentx_pid=""
if [ "${KVTIER_WITH_AGENTX:-1}" = 1 ]; then
  mkdir -p build
  bash scripts/setup_agentx.sh >build/agentx-install.log 2>&1 &
  agentx_pid=$!
fi
# SGLang for the HiCache storage backend's conformance tests, likewise (KVTIER_WITH_SGLANG=0 skips
# it; tests/integrations/test_sglang_storage.py then skips, saying why).
sglang_pid=""
if [ "${KVTIER_WITH_SGLANG:-1}" = 1 ]; then
  mkdir -p build
  bash scripts/setup_sglang.sh >build/sglang-install.log 2>&1 &
  sglang_pid=$!
fi
# C++ host tests, plain and under AddressSanitizer + UndefinedBehaviorSanitizer.
for variant in "host -DCMAKE_BUILD_TYPE=Release" "host-asan -DCMAKE_BUILD_TYPE=Debug -DKVTIER_SANITIZE=ON"; do
  dir="build/${variant%% *}"
  # shellcheck disable=SC2086
  cmake -S . -B "$dir" -DKVTIER_BUILD_PYTHON=OFF ${variant#* } >/dev/null
  cmake --build "$dir" -j "$(nproc)" >/dev/null
  ctest --test-dir "$dir" --output-on-failure
done
# HIP kernels: compile for NVIDIA and AMD targets (fails on any error or VGPR spill).
bash hip/check_compile.sh
# Ahead-of-time compile gate: fails on any build error or spill (the table in perf/results/ is
# written by running it without --no-write).
python perf/compile_gate.py --no-write
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid" || { echo "vLLM install failed (build/vllm-install.log):"; tail -20 build/vllm-install.log; exit 1; }
  tail -1 build/vllm-install.log
fi
if [ -n "$agentx_pid" ]; then
  wait "$agentx_pid" || { echo "AgentX harness install failed (build/agentx-install.log):"; tail -20 build/agentx-install.log; exit 1; }
  tail -1 build/agentx-install.log
fi
if [ -n "$sglang_pid" ]; then
  wait "$sglang_pid" || { echo "SGLang install failed (build/sglang-install.log):"; tail -20 build/sglang-install.log; exit 1; }
  tail -1 build/sglang-install.log
fi
# One pytest worker per core, each test file on one worker (its module fixtures built once);
# KVTIER_TEST_WORKERS=0 runs the tests in this process, one after the other.
python -m pytest -n "${KVTIER_TEST_WORKERS:-auto}" --dist loadfile "$@"
