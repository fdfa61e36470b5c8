"""The kvtier command: one thin module per subcommand (parse, then call a library function).

Subcommands:
  bench               replay coding-agent sessions (a trace or the built-in workload) under
                      several cache configurations; prints TTFT/TPOT/throughput/hits per tier,
                      writes a TTFT plot and, with --json, the numbers with provenance
  simulate            the same replay at cluster scale in virtual time: the real scheduler and
                      tiered pool with the model's step time and every copy modelled (8x MI355X
                      running Kimi K2 by default); prints the bench table, writes a plot and JSON
  generate            offline generation over synthetic prompts that share a prefix; prints
                      TTFT / end-to-end latency / throughput and prefix-cache hits
  create-checkpoint   write a deterministic random HF-layout weights directory (bf16, fp32, fp8 or int4)
  plan                weights per device, KV bytes per token and KV capacity of a model in
                      INT4 / FP8 / bf16 weights on N devices (kvtier.model.plan)
  serve               OpenAI-compatible HTTP server: chat (tools streamed as each call completes),
                      completions, sessions kept warm across tool waits, /metrics
  kernels             --profile DIR: every kernel op once under torch.profiler, a Chrome trace
  router              an OpenAI-compatible router in front of several kvtier serve workers
  cluster             a store, N kvtier serve workers and a router (processes, or placed by Ray)
"""

from __future__ import annotations

import argparse
import sys

from kvtier.cli import bench, cluster, create_checkpoint, generate, kernels, plan, router, serve, simulate
from kvtier.cluster import StartupError

SUBCOMMANDS = (bench, simulate, generate, create_checkpoint, plan, kernels, serve, router, cluster)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, StartupError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130
