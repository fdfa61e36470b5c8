"""Decode step time, eager vs replayed from a CUDA/HIP graph, for batch 1-64: one CSV row per batch.

Columns: model, batch, context, eager_ms, graph_ms, eager_over_graph, device, commit.

A step is what the engine's runner does for a decode-only step: plan (one host read of the
metadata), the model's forward and the logits of every row; eager runs the forward, the graph path
copies the inputs into the static buffers of :class:`kvtier.serve.cuda_graph.DecodeGraphs` and
replays (captured once per padded batch size before timing). Method: every sequence at
``--context`` cached tokens on shuffled pages; one warm-up step, then the median of ``--repeats``
steps, each timed on the host after a device synchronisation (a step ends with the logits on the
device). Weights are random (normal, std 0.02; norms 1). Models: ``tiny`` (the preset) and
``k2-slice`` (K2's attention and hidden widths, ``--layers`` layers, 16 routed experts of K2's size:
the per-layer kernels of K2 at a size one GPU holds). ``--dry-run`` (or no GPU): eager only, tiny,
on CPU, to catch errors.

Usage: python perf/bench_decode_graph.py [--model tiny|k2-slice] [--layers 4] [--context 1024]
       [--repeats 20] [--csv out.csv] [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from kvtier.model import preset
from kvtier.model.batch import AttentionBatch
from kvtier.model.kimi_k2 import KimiK2ForCausalLM
from kvtier.provenance import git_commit
from kvtier.serve.cuda_graph import DecodeGraphs, graph_batch_sizes
from timing import append_csv

PAGE_SIZE = 64


def build_model(name: str, layers: int, device: torch.device, dtype: torch.dtype) -> KimiK2ForCausalLM:
    config = preset("tiny")
    if name == "k2-slice":
        config = dataclasses.replace(preset("kimi-k2"), num_hidden_layers=layers, first_k_dense_replace=1,
                                     n_routed_experts=16, n_group=1, topk_group=1)
    model = KimiK2ForCausalLM(config, dtype).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(0.0 if name_.endswith("e_score_correction_bias") else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def decode_inputs(model, batch: int, context: int, num_pages: int, device):
    """Token ids, positions and the unplanned metadata of a decode step at ``context`` tokens each."""
    pages_per_seq = -(-context // PAGE_SIZE)
    perm = torch.randperm(num_pages, device=device)[:batch * pages_per_seq].to(torch.int32)
    block_table = perm.view(batch, pages_per_seq)
    last = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    slots = block_table.gather(1, (last // PAGE_SIZE)[:, None]).squeeze(1).long() * PAGE_SIZE + last % PAGE_SIZE
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=device)
    attn = AttentionBatch(slot_mapping=slots, num_prefill_tokens=0, decode_block_table=block_table,
                          decode_seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device))
    return ids, last, attn


def median_ms(fn, repeats: int, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["tiny", "k2-slice"], default="tiny")
    p.add_argument("--layers", type=int, default=4, help="layers of k2-slice")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--csv", default=None)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    gpu = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if gpu else "cpu")
    model_name = args.model if gpu else "tiny"
    context = args.context if gpu else 40
    model = build_model(model_name, args.layers, device, torch.bfloat16 if gpu else torch.float32)
    sizes = graph_batch_sizes(64) if gpu else [1, 4]
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = sizes[-1] * pages_per_seq + 1
    caches = [torch.zeros(num_pages, PAGE_SIZE, model.config.kv_cache_dim, dtype=model.dtype, device=device)
              for _ in range(model.config.num_hidden_layers)]
    graphs = DecodeGraphs(model, caches, sizes[-1], pages_per_seq) if gpu else None
    rows, commit = [], git_commit()
    with torch.inference_mode():
        for batch in sizes:
            ids, positions, attn = decode_inputs(model, batch, context, num_pages, device)

            def eager():
                planned = model.plan(positions, attn, caches)
                return model.compute_logits(model(ids, positions, planned, caches))

            def replay():
                return graphs.run(ids, positions, model.plan(positions, attn, caches))

            eager_ms = median_ms(eager, args.repeats, device)
            graph_ms = median_ms(replay, args.repeats, device) if graphs else float("nan")
            rows.append({"model": model_name, "batch": batch, "context": context, "eager_ms": round(eager_ms, 3),
                         "graph_ms": round(graph_ms, 3), "eager_over_graph": round(eager_ms / graph_ms, 2),
                         "device": torch.cuda.get_device_name(device) if gpu else "cpu", "commit": commit})
            print(rows[-1], flush=True)
    if args.csv:
        append_csv(args.csv, rows)


if __name__ == "__main__":
    main()
