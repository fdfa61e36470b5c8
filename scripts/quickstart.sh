#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: a short generation with the tiny random
# Kimi K2-shaped model over prompts that share a prefix, reporting TTFT, throughput and
# prefix-cache hits. Extra arguments go to `kvtier generate`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
. scripts/setup.sh
kvtier generate --model tiny --num-prompts 8 --prompt-len 512 --shared-prefix-len 448 --max-tokens 32 "$@"
