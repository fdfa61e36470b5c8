"""Decode steps replayed from CUDA/HIP graphs, one graph per padded batch size.

A decode-only step of ``n`` sequences runs the graph of the smallest captured size ``bs >= n``.
Each graph reads static buffers (input_ids, positions, slot_mapping, block_table, seq_lens) that
a step fills in place before replaying; rows ``n..bs`` are padding: slot -1 (no cache write),
length 0 (attention returns 0), position 0, page 0. The attention plan of a graph is made once at
capture for the longest sequence the block table can hold (``max_pages * page_size``), so its
split count is valid for every replay; the values of each step are still checked on the host,
once, by :meth:`KimiK2ForCausalLM.plan` before they are copied in. Graphs are captured on first
use of a size (a warm-up run first compiles the Triton kernels) and share one memory pool.
"""

from __future__ import annotations

import torch

from kvtier.model.batch import AttentionBatch
from kvtier.model.kimi_k2 import KimiK2ForCausalLM

MAX_GRAPH_BATCH = 64


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, .. up to ``min(max_num_seqs, 64)`` (that bound itself included)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return sizes + [top]


class DecodeGraphs:
    """Captured decode steps of one model over one set of per-layer caches.

    Args:
        model: the model (on a CUDA/ROCm device).
        kv_caches: its per-layer caches [num_pages, page_size, R + P].
        max_num_seqs: the most sequences of a decode step.
        max_pages: block table width of the static buffers (pages one sequence may hold).

    Raises:
        ValueError: the model is not on a CUDA/ROCm device.
    """

    def __init__(self, model: KimiK2ForCausalLM, kv_caches: list[torch.Tensor], max_num_seqs: int, max_pages: int):
        device = model.embed_tokens.device
        if device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA/ROCm device, got device {str(device)!r}")
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = graph_batch_sizes(max_num_seqs)
        top = self.sizes[-1]
        self.max_pages = max_pages
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(top, max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, num_seqs: int, block_table_width: int) -> bool:
        """Whether a decode step of this many sequences and pages can replay a graph."""
        return 0 < num_seqs <= self.sizes[-1] and block_table_width <= self.max_pages

    def _size_for(self, num_seqs: int) -> int:
        return next(bs for bs in self.sizes if bs >= num_seqs)

    def _planned(self, bs: int) -> AttentionBatch:
        """The first ``bs`` rows of the static buffers as a batch planned for the block table's capacity."""
        batch = AttentionBatch(slot_mapping=self.slot_mapping[:bs], num_prefill_tokens=0,
                               decode_seq_lens=self.seq_lens[:bs], decode_block_table=self.block_table[:bs])
        return self.model.plan(self.positions[:bs], batch, self.kv_caches,
                               decode_max_seq_len=self.max_pages * self.kv_caches[0].shape[1])

    def _step(self, bs: int, planned: AttentionBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(self.input_ids[:bs], self.positions[:bs], planned, self.kv_caches))

    def _capture(self, bs: int) -> None:
        self.slot_mapping[:bs] = -1  # the warm-up and capture runs write nothing into the caches
        self.seq_lens[:bs] = 1
        planned = self._planned(bs)  # its host reads happen here, before the capture
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(bs, planned)  # compiles the Triton kernels outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(bs, planned)
        self.pool = graph.pool()
        self.graphs[bs] = (graph, logits)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Replay the decode step of ``batch`` (planned: its values were checked); returns [n, vocab] fp32 logits.

        Raises:
            ValueError: the step has prefill tokens or does not fit (:meth:`fits`).
        """
        n = input_ids.shape[0]
        width = batch.decode_block_table.shape[1] if n else 0
        if batch.num_prefill_tokens or not self.fits(n, width):
            raise ValueError(f"a graph replays decode-only steps of 1..{self.sizes[-1]} sequences and <= "
                             f"{self.max_pages} pages each, got {batch.num_prefill_tokens} prefill tokens, {n} "
                             f"sequences, {width} pages")
        bs = self._size_for(n)
        if bs not in self.graphs:
            self._capture(bs)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.positions[n:bs].zero_()
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.block_table[:bs].zero_()
        self.block_table[:n, :width].copy_(batch.decode_block_table)
        self.seq_lens[:n].copy_(batch.decode_seq_lens)
        self.seq_lens[n:bs].zero_()
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:n]
