"""``kvtier kernels --profile DIR``: every kernel op once under torch.profiler, a Chrome trace
(see :mod:`kvtier.ops.profile`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvtier.ops.dispatch import BACKENDS
from kvtier.ops.profile import profile_kernels


def cmd_kernels(args: argparse.Namespace) -> int:
    if args.profile is None:
        raise ValueError("nothing to do: pass --profile DIR")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = profile_kernels(Path(args.profile), device, args.backend)
    print(f"trace: {path} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def add_parser(sub) -> None:
    """Register ``kvtier kernels`` on the CLI's subparsers."""
    k = sub.add_parser("kernels", help="run every kernel op once under torch.profiler and write a Chrome trace")
    k.add_argument("--profile", metavar="DIR", help="directory for the trace (kvtier_kernels.json)")
    k.add_argument("--backend", default="auto", choices=BACKENDS, help="kernel backend of every op")
    k.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    k.set_defaults(func=cmd_kernels)
