#!/usr/bin/env bash
# .agentx-venv/: the AgentX harness (PyPI agentx-harness, built on AIPerf) for the bounded trace
# replay against `kvtier serve` (tests/bench/test_agentx_replay.py, perf/kv_cache_tester_replay.py
# --client agentx), in a venv of its own. About a minute; without it that test skips, saying why.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if .agentx-venv/bin/aiperf --version >/dev/null 2>&1; then
  exit 0
fi
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
"${PYTHON:-python3}" -m venv .agentx-venv
.agentx-venv/bin/python -m pip install -q "agentx-harness==1.0.12" 2>&1 | quiet
echo "AgentX harness ready: $(.agentx-venv/bin/aiperf --version 2>&1 | tail -1)"
