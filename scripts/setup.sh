#!/usr/bin/env bash
# Set up the development environment inside the repository:
#   .venv/ (created if missing), torch==2.13.0 when the venv has no torch (a bare `torch`
#   requirement would pull a multi-GB CUDA build), then kvtier itself (editable, with its
#   native extension kvtier._C and the test extras).
# Source it (". scripts/setup.sh") to stay in the venv; the other scripts do.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# System packages of the remote tier's stores (redis-server for the Redis backend and tests,
# libibverbs for Mooncake Store, needed even over TCP); installed only when missing.
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
dpkg -s libibverbs1 >/dev/null 2>&1 || need_apt+=(libibverbs1)
dpkg -s ibverbs-providers >/dev/null 2>&1 || need_apt+=(ibverbs-providers)
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y "${need_apt[@]}" >/dev/null 2>&1 \
    || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y "${need_apt[@]}" >/dev/null; }
fi
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q torch==2.13.0 2>&1 | quiet
fi
python -m pip install -q -e ".[test]" 2>&1 | quiet
python -c "import kvtier._C, torch; print('kvtier ready: torch', torch.__version__)"
# vLLM for the connector's end-to-end test (tests/integrations/test_vllm_connector.py), in a venv
# of its own: only with KVTIER_WITH_VLLM=1 (scripts/test.sh installs it in the background).
if [ "${KVTIER_WITH_VLLM:-0}" = 1 ]; then
  bash scripts/setup_vllm.sh
fi
export KVTIER_VLLM_PYTHON="$ROOT/.vllm-venv/bin/python"
