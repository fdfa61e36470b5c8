"""``kvtier create-checkpoint PATH``: a deterministic random HF-layout weights directory (see
:func:`kvtier.model.create_random_checkpoint`)."""

from __future__ import annotations

import argparse

from kvtier.model import PRESETS, create_random_checkpoint
from kvtier.model.checkpoint import WEIGHT_DTYPES
from kvtier.model.config import did_you_mean


def preset_name(value: str) -> str:
    """``value`` if it names a preset (:data:`kvtier.model.PRESETS`).

    Raises:
        argparse.ArgumentTypeError: another name, with the nearest preset when one is close.
    """
    if value not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {value!r}{did_you_mean(value)} (choose from "
                                         f"{', '.join(sorted(PRESETS))})")
    return value


def cmd_create_checkpoint(args: argparse.Namespace) -> int:
    if args.tokenizer is not None:
        from kvtier.tokenize import copy_tokenizer, load_tokenizer

        load_tokenizer(args.tokenizer)  # a bad directory is refused before anything is written
    path = create_random_checkpoint(args.path, args.preset, args.seed, args.dtype)
    with_tokenizer = ""
    if args.tokenizer is not None:
        from kvtier.model.config import preset
        from kvtier.tokenize.formats import model_chat_format

        chat_format = model_chat_format(preset(args.preset).model_type)  # K3: K3's control tokens
        copy_tokenizer(args.tokenizer, path, chat_format=chat_format)
        with_tokenizer = f" with the tokenizer of {args.tokenizer} ({chat_format.value} chat format)"
    print(f"wrote {args.dtype} checkpoint of preset {args.preset!r} (seed {args.seed}) to {path}{with_tokenizer}")
    return 0


def add_parser(sub) -> None:
    """Register ``kvtier create-checkpoint`` on the CLI's subparsers."""
    c = sub.add_parser("create-checkpoint", help="write a deterministic random HF-layout weights directory")
    c.add_argument("path", help="output directory (config.json, safetensors shards, index)")
    c.add_argument("--preset", default="tiny", type=preset_name, choices=sorted(PRESETS),
                   help="model shape (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="the same seed writes the same bytes")
    c.add_argument("--dtype", default="bfloat16", choices=list(WEIGHT_DTYPES),
                   help="fp8 = e4m3 linear weights with 128x128 weight_scale_inv block scales (DeepSeek-V3, K2); "
                        "int4 = routed experts compressed-tensors INT4 group-32 (K2 Thinking, K2.6); "
                        "mxfp4 = routed experts compressed-tensors mxfp4-pack-quantized (K3; hybrid presets) "
                        "(default: %(default)s)")
    c.add_argument("--tokenizer", metavar="DIR",
                   help="copy the Kimi tokenizer of DIR (tiktoken.model, tokenizer_config.json) into the weights directory, "
                        "so that kvtier serve PATH needs no --tokenizer (e.g. ../shared/kimi_tokenizer); a K3 "
                        "model (model_type kimi_k3) gets K3's tokenizer_config.json (its control tokens) instead")
    c.set_defaults(func=cmd_create_checkpoint)
