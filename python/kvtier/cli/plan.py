"""``kvtier plan``: weights per device, KV bytes per token and the KV tokens and sessions that fit,
for a model in INT4 / FP8 / bf16 weights on N devices (see :mod:`kvtier.model.plan`)."""

from __future__ import annotations

import argparse

from kvtier.model import PRESETS


def cmd_plan(args: argparse.Namespace) -> int:
    from kvtier.model.plan import plan_report

    print(plan_report(args.model, tuple(args.format.split(",")), args.devices, args.hbm_gb, parallel=args.parallel,
                      kv_dtype_bytes=args.kv_dtype_bytes, hbm_fraction=args.hbm_fraction, reserve_gb=args.reserve_gb,
                      session_tokens=args.session_tokens))
    return 0


def add_parser(sub) -> None:
    """Register ``kvtier plan`` on the CLI's subparsers."""
    p = sub.add_parser("plan", help="memory plan: weights per device, KV per token, KV tokens and sessions that fit")
    p.add_argument("--model", default="kimi-k2", help=f"preset {sorted(PRESETS)}, checkpoint directory or config.json")
    p.add_argument("--devices", type=int, default=8, help="accelerators")
    p.add_argument("--hbm-gb", type=float, default=288, help="HBM per device, GB (MI355X 288, H200 141)")
    p.add_argument("--format", default="int4,fp8,bf16", help="comma-separated weight formats: int4 (K2.6), fp8 (K2), bf16")
    p.add_argument("--parallel", default="dp-ep", choices=["dp-ep", "tp"],
                   help="dp-ep: attention replicated, KV per device summed; tp: all split, KV replicated")
    p.add_argument("--kv-dtype-bytes", type=float, default=2, help="bytes per cached KV value (2 = bf16, 1 = FP8)")
    p.add_argument("--hbm-fraction", type=float, default=0.9, help="share of HBM the engine takes")
    p.add_argument("--reserve-gb", type=float, default=8, help="per-device allowance for activations and workspace, GB")
    p.add_argument("--session-tokens", type=int, default=100_000, help="tokens per session for the session count")
    p.set_defaults(func=cmd_plan)
