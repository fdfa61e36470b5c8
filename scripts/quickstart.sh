#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: `kvtier bench` replays the built-in
# coding-agent workload (16 sessions, 8 at a time, statistics from docs/workload.md)
# through the tiny random Kimi K2-shaped model, once with a device-only prefix cache and once
# with the tiered pool, and prints TTFT/TPOT/throughput/hits per tier for both. Extra arguments
# go to `kvtier bench` (e.g. --trace ../shared/traces/kv-cache-tester --json out.json).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
. scripts/setup.sh
kvtier bench "$@"
