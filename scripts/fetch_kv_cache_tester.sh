#!/usr/bin/env bash
# Fetch kv-cache-tester (the trace replay client of the public agent benchmarks) at a pinned
# commit into DIR, with a virtual environment of its own in DIR/.venv. Needs GitHub and PyPI.
# Nothing of it is kept in this repository.
#
#   bash scripts/fetch_kv_cache_tester.sh /tmp/kv-cache-tester
#   python perf/kv_cache_tester_replay.py --tester /tmp/kv-cache-tester
set -euo pipefail
DIR="${1:?usage: fetch_kv_cache_tester.sh DIR}"
REPO="${KV_CACHE_TESTER_REPO:-https://github.com/callanjfox/kv-cache-tester}"
COMMIT="94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf"  # 2026-07-12, "docs: split circuit-breaker ..."

if [ ! -f "$DIR/trace_replay_tester.py" ]; then
  git init -q "$DIR"
  git -C "$DIR" remote add origin "$REPO"
  # blobs on demand: the repository also holds large trace files this needs none of
  git -C "$DIR" fetch -q --depth 1 --filter=blob:none origin "$COMMIT"
  git -C "$DIR" checkout -q FETCH_HEAD -- trace_replay_tester.py vocabulary.py requirements.txt
fi
if [ ! -x "$DIR/.venv/bin/python" ]; then
  python3 -m venv "$DIR/.venv"
  # its imports: the tokenizer only (no torch), the OpenAI client, pandas/plotly for its reports
  "$DIR/.venv/bin/pip" install -q openai aiohttp numpy pandas plotly transformers tokenizers
fi
echo "kv-cache-tester $COMMIT in $DIR (python: $DIR/.venv/bin/python)"
