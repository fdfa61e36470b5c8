#!/usr/bin/env bash
# .sglang-venv/: SGLang for the HiCache storage backend's conformance tests
# (tests/integrations/test_sglang_*.py) and perf/sglang_storage_bench.py, in a venv of its own.
# sglang==0.5.23 pins torch==2.14.1 and CUDA wheels (flashinfer, cutlass, deep-gemm, ...) that a
# CPU host does not need: `pip install sglang==0.5.23` pulls a CUDA torch and its NVIDIA libraries
# (a 6 GB venv). The tests import only SGLang's storage classes (HiCacheStorage, the backend
# factory, the CPU host pools, the cache controller), so sglang goes in without its dependencies,
# on the local CPU torch==2.13.0, with the few packages those imports need; a constraint keeps
# torch at 2.13.0. Those imports reach torchvision (sglang.srt.configs -> internvl_utils imports
# torchvision.transforms); every torchvision wheel on PyPI is built for a CUDA torch, and from
# 0.17 on its import fails when its C++ ops do not load, so torchvision 0.16.2 goes in without
# dependencies: its ops do not load on this torch (a warning), its Python transforms import, and
# no storage path calls either.
# kvtier itself is not installed: the tests put this checkout's python/ on PYTHONPATH. Without
# this venv those tests skip, saying why.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV=.sglang-venv
check='from sglang.srt.managers.cache_controller import HiCacheController; import sglang; print("SGLang ready:", sglang.__version__)'
if "$VENV/bin/python" -c "$check" 2>/dev/null; then
  exit 0
fi
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" -e "sglang 0.5.23 requires" \
  -e "dependency resolver does not currently" || true; }
"${PYTHON:-python3}" -m venv "$VENV"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" >"$constraints"
pip_install() { "$VENV/bin/python" -m pip install -q -c "$constraints" "$@" 2>&1 | quiet; }
pip_install torch==2.13.0
pip_install --no-deps sglang==0.5.23
# What `import sglang.srt.managers.cache_controller` and the host pools import, and no more.
pip_install numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq \
  tqdm ipython aiohttp dill gguf "apache-tvm-ffi==0.1.11" "transformers==5.19.0" "sentencepiece==0.2.1" \
  "compressed-tensors" "triton" "redis>=5" "google-crc32c>=1.5" "pytest>=8"
pip_install --no-deps torchvision==0.16.2
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
"$VENV/bin/python" -c "$check"
