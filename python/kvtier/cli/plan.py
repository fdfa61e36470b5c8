"""``kvtier plan``: weights per device, KV bytes per token and the KV tokens and sessions that fit,
for a model in INT4 / FP8 / bf16 weights on N devices; for a hybrid model (``--model kimi-k3``, MXFP4 /
bf16) also the KDA state per sequence and the sessions of 128K, 400K and 1M tokens that fit (see
:mod:`kvtier.model.plan`)."""

from __future__ import annotations

import argparse

from kvtier.model import PRESETS


def cmd_plan(args: argparse.Namespace) -> int:
    from kvtier.model.plan_report import plan_report

    formats = tuple(args.format.split(",")) if args.format else None
    print(plan_report(args.model, formats, args.devices, args.hbm_gb, parallel=args.parallel,
                      kv_dtype_bytes=args.kv_dtype_bytes, hbm_fraction=args.hbm_fraction, reserve_gb=args.reserve_gb,
                      session_tokens=args.session_tokens, state_dtype=args.state_dtype,
                      state_device_bytes=args.state_device_bytes))
    return 0


def add_parser(sub) -> None:
    """Register ``kvtier plan`` on the CLI's subparsers."""
    p = sub.add_parser("plan", help="memory plan: weights per device, KV per token, KV tokens and sessions that fit")
    p.add_argument("--model", default="kimi-k2", help=f"preset {sorted(PRESETS)}, weights directory or config.json")
    p.add_argument("--devices", type=int, default=8, help="accelerators")
    p.add_argument("--hbm-gb", type=float, default=288, help="HBM per device, GB (MI355X 288, H200 141)")
    p.add_argument("--format", default=None,
                   help="comma-separated weight formats: int4 (K2.6), fp8 (K2), bf16 (default int4,fp8,bf16); "
                        "hybrid models: mxfp4 (K3), bf16 (default both)")
    p.add_argument("--parallel", default=None, choices=["dp-ep", "tp"],
                   help="dp-ep: attention replicated, KV per device summed; tp: all split, KV replicated "
                        "(default dp-ep; hybrid models: both)")
    p.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="hybrid models: dtype of the KDA recurrent state per sequence (conv windows in bf16) "
                        "(default: %(default)s)")
    p.add_argument("--kv-dtype-bytes", type=float, default=2, help="bytes per cached KV value (2 = bf16, 1 = FP8)")
    p.add_argument("--hbm-fraction", type=float, default=0.9, help="share of HBM the engine takes")
    p.add_argument("--reserve-gb", type=float, default=8, help="per-device allowance for activations and workspace, GB")
    p.add_argument("--session-tokens", type=int, default=None,
                   help="tokens per session for the session count, at most the model's context (default 100,000; "
                        "hybrid: 128K, 400K and 1M; lengths past the context are left out)")
    p.add_argument("--state-device-bytes", type=float, default=None, metavar="BYTES",
                   help="hybrid models: device checkpoint budget per device, as kvtier serve --state-device-bytes "
                        "reserves it (default: serve's, as many bytes as the device KV; 0 = none)")
    p.set_defaults(func=cmd_plan)
