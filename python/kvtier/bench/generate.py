"""``kvtier generate``: offline generation over synthetic shared-prefix prompts, measured."""

from __future__ import annotations

import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from kvtier.llm import LLM
from kvtier.ops import resolve_backend
from kvtier.provenance import provenance
from kvtier.serve.params import SamplingParams


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _synthetic_prompts(n: int, length: int, shared: int, vocab: int, seed: int) -> list[list[int]]:
    if not 0 <= shared <= length:
        raise ValueError(f"--shared-prefix-len must be in [0, --prompt-len={length}], got {shared}")
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (length - shared,), generator=g).tolist() for _ in range(n)]


def run_generate(args, console: Console) -> int:
    """``kvtier generate``: offline generation over synthetic prompts sharing a prefix (``args``:
    the parsed options: model, num_prompts, prompt_len, shared_prefix_len, max_tokens,
    temperature, page_size, num_device_pages, host_cache_bytes, max_num_batched_tokens,
    max_num_seqs, seed, json). Prints TTFT / end-to-end latency / throughput and prefix-cache
    hits; writes them to ``args.json`` when given. Returns 0.

    Raises:
        ValueError: a count below 1.
    """
    if args.num_prompts < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts, --prompt-len and --max-tokens must be >= 1")
    t0 = time.perf_counter()
    llm = LLM(args.model, seed=args.seed, page_size=args.page_size, num_device_pages=args.num_device_pages,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              host_cache_bytes=args.host_cache_bytes)
    load_s = time.perf_counter() - t0
    prompts = _synthetic_prompts(args.num_prompts, args.prompt_len, args.shared_prefix_len,
                                 llm.config.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    # The first prompt warms the prefix cache alone, as a returning agent turn would find it.
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    outs += llm.generate(prompt_token_ids=prompts[1:], sampling_params=params) if len(prompts) > 1 else []
    wall = time.perf_counter() - t0
    ttft = [o.metrics.ttft_s * 1e3 for o in outs]
    e2e = [o.metrics.e2e_s * 1e3 for o in outs]
    generated = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(o.num_cached_tokens for o in outs)
    by_tier = {t: sum(o.cached_tokens_by_tier.get(t, 0) for o in outs) for t in ("device", "host", "disk")}
    result = {
        "provenance": provenance(model=args.model, backend=resolve_backend(
            "mla_decode", "auto", llm.engine.runner.device, llm.engine.runner.model.dtype),
            dtype=str(llm.engine.runner.model.dtype), args=vars(args) | {"func": None}),
        "requests": len(outs), "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached,
        "hit_tokens": by_tier, "copy_errors": llm.engine.stats().pool.copy_errors,
        "generated_tokens": generated, "wall_s": wall, "load_s": load_s,
        "ttft_ms": {"p50": statistics.median(ttft), "p99": _percentile(ttft, 99)},
        "e2e_ms": {"p50": statistics.median(e2e), "p99": _percentile(e2e, 99)},
        "throughput_tok_s": (prompt_tokens - cached + generated) / wall,
        "output_tok_s": generated / wall,
    }
    table = Table(title=f"kvtier generate — {args.model}, {len(outs)} requests")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("prompt tokens (served from cache)", f"{prompt_tokens} ({cached}, {cached / prompt_tokens:.0%})"),
        ("  of which device / host / disk", " / ".join(str(by_tier[t]) for t in ("device", "host", "disk"))),
        ("generated tokens", str(generated)),
        ("TTFT p50 / p99 (ms)", f"{result['ttft_ms']['p50']:.1f} / {result['ttft_ms']['p99']:.1f}"),
        ("end-to-end p50 / p99 (ms)", f"{result['e2e_ms']['p50']:.1f} / {result['e2e_ms']['p99']:.1f}"),
        ("throughput, computed tokens/s", f"{result['throughput_tok_s']:.1f}"),
        ("output tokens/s", f"{result['output_tok_s']:.1f}"),
        ("wall / model load (s)", f"{wall:.2f} / {load_s:.2f}"),
        ("backend", result["provenance"]["backend"]),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0


