"""``kvtier generate``: offline generation over synthetic shared-prefix prompts (see
:mod:`kvtier.bench.generate`)."""

from __future__ import annotations

import argparse

from rich.console import Console

from kvtier.model import PRESETS


def cmd_generate(args: argparse.Namespace) -> int:
    from kvtier.bench.generate import run_generate

    return run_generate(args, Console())


def add_parser(sub) -> None:
    """Register ``kvtier generate`` on the CLI's subparsers."""
    g = sub.add_parser("generate", help="offline generation over synthetic shared-prefix prompts")
    g.add_argument("--model", default="tiny", help=f"weights directory or preset {sorted(PRESETS)}")
    g.add_argument("--num-prompts", type=int, default=8)
    g.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    g.add_argument("--shared-prefix-len", type=int, default=448, help="tokens all prompts share")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (power of two)")
    g.add_argument("--num-device-pages", type=int, default=1024, help="pages per layer in the device KV pool")
    g.add_argument("--host-cache-bytes", type=int, default=0, help="host-memory KV tier budget (0 = none)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    g.set_defaults(func=cmd_generate)
