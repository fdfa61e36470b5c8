#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the C++ host tests (ctest) and the Python tests (pytest).
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
. scripts/setup.sh
cmake -S . -B build/host -DKVTIER_BUILD_PYTHON=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/host -j "$(nproc)" >/dev/null
ctest --test-dir build/host --output-on-failure
python -m pytest "$@"
