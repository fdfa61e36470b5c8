"""Model runner: turns a scheduled batch into tensors, runs the model, returns logits.

:class:`StepRunner` is the seam between ``Engine.begin_step`` and ``Engine.end_step``: anything
that runs a :class:`ScheduledBatch` and returns a :class:`StepResult` (the model here; a timed
runner in the simulator, :mod:`kvtier.sim.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.cache.checkpoints.index import Checkpoint
from kvtier.model.batch import AttentionBatch
from kvtier.model.cache_spec import CacheSpec
from kvtier.model.step import StepModel
from kvtier.serve.config import EngineConfig
from kvtier.serve.hybrid_state import recurrent_state
from kvtier.serve.request import Sequence
from kvtier.serve.step_plan import ScheduledBatch


@dataclass
class SeqLogits:
    """Logits one sequence needs from a step.

    Attributes:
        next_token: [vocab] fp32 logits of the last token when the step reaches the sequence's
            end (a token must be sampled), else None.
        prompt_positions: positions p whose logits score prompt token p + 1.
        prompt_logits: [len(prompt_positions), vocab] fp32.
    """

    next_token: torch.Tensor | None
    prompt_positions: list[int]
    prompt_logits: torch.Tensor | None


@dataclass
class StepResult:
    """What one step's run gives :meth:`kvtier.serve.engine.Engine.end_step`.

    Attributes:
        logits: by ``seq_id``, the logits each sequence needs (a model runner); the engine
            samples from them.
        tokens: by ``seq_id``, a token the runner chose itself for a sequence that reached its end
            (a timed runner without a model); used as sampled, without logprobs.
        seconds: the step's duration when the runner models it (virtual time); None = measured on
            the engine's clock from ``begin_step`` to ``end_step``.
        checkpoints: the recurrent-state checkpoints the step produced (a hybrid model's prefill
            boundaries, and the turn ends of sequences preempted since the last step), for the
            engine to hand the pool.
        turn_ends: by ``seq_id``, the turn end each decoding sequence leaves if it stops now (its
            last decode page boundary); the engine saves those of the sequences that finished.
    """

    logits: dict[int, SeqLogits] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    seconds: float | None = None
    checkpoints: list[Checkpoint] = field(default_factory=list)
    turn_ends: dict[int, Checkpoint] = field(default_factory=dict)


class StepRunner(Protocol):
    """What the engine runs its batches with.

    Attributes:
        model_config: the model's limits the engine checks requests against
            (``vocab_size``, ``max_position_embeddings``, ``eos_token_id``).
        device: where sampling generators live.
        kv_caches: per layer ``[num_device_pages, page_size, row]`` page pools the pool copies from
            and to.
    """

    model_config: object
    device: torch.device
    kv_caches: list[torch.Tensor]

    def run(self, batch: ScheduledBatch) -> StepResult:
        """Run one step (``num_computed_tokens`` of each sequence not yet advanced)."""
        ...


def _allocate_kv_caches(spec: CacheSpec, config: EngineConfig, device) -> list[torch.Tensor]:
    """One zeroed ``[num_device_pages, page_size, kv_width]`` page pool per KV layer of ``spec``
    (every layer of K2; the MLA layers of a hybrid model).

    Raises:
        ValueError: the pools do not fit on ``device`` (naming ``num_device_pages`` and the bytes).
    """
    shape = spec.kv_cache_shape(config.pool.num_device_pages, config.pool.page_size)
    layers = spec.kv_layers
    try:
        return [torch.zeros(shape, dtype=spec.kv_dtype, device=device) for _ in range(layers)]
    except RuntimeError as e:  # torch.OutOfMemoryError, or the CPU allocator's enforce failure
        per_layer = config.pool.num_device_pages * config.pool.page_size * spec.kv_row_bytes
        raise ValueError(f"num_device_pages={config.pool.num_device_pages} needs {per_layer * layers:,} bytes of KV "
                         f"cache on {device} ({layers} layers x {per_layer:,} bytes), which could not be "
                         f"allocated: {str(e).splitlines()[0][:200]}") from None


class ModelRunner:
    """Owns the model and what its cache spec declares (``model.cache_spec()``): one
    ``[num_device_pages, page_size, kv_width]`` page pool per KV layer and, for a model with a
    recurrent state (a hybrid model, :mod:`kvtier.model.kimi_linear`), ``max_num_seqs`` state slots
    (:func:`~kvtier.serve.hybrid_state.recurrent_state`), which take checkpoints every
    ``config.pool.state_checkpoint_tokens`` when the pool keeps them (the engine derives that
    config from the spec, :func:`~kvtier.serve.hybrid_state.cache_config`). Every model runs
    through the same step (:class:`kvtier.model.step.StepModel`).

    Raises:
        ValueError: the page pools do not fit, or ``cuda_graph`` with a hybrid model.
    """

    def __init__(self, model: StepModel, config: EngineConfig):
        self.model = model
        self.model_config = model.config
        device = model.embed_tokens.device
        self.device = device
        self.kv_caches = _allocate_kv_caches(model.cache_spec(), config, device)
        self.recurrent_state = recurrent_state(model, config)  # the sequences' state slots (none for K2)
        self.config = config
        self.graphs = None  # decode steps replayed from CUDA/HIP graphs (config.cuda_graph)
        if config.cuda_graph:
            from kvtier.serve.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.kv_caches, config.max_num_seqs, config.pool.num_device_pages)

    def _block_table(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.page_ids) for s in seqs)
        rows = [s.page_ids + [0] * (width - len(s.page_ids)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        ps = self.config.pool.page_size
        return [seq.page_ids[p // ps] * ps + p % ps for p in range(start, end)]

    def prepare(self, batch: ScheduledBatch):
        """(input_ids [T] int64, positions [T] int64, AttentionBatch, per-token (seq, position))."""
        ids, pos, slots, owners = [], [], [], []
        chunks = [(s, n) for s, n in batch.extends] + [(s, 1) for s in batch.decodes]
        for seq, n in chunks:
            start = seq.num_computed_tokens
            ids += seq.token_ids(start, start + n)
            pos += range(start, start + n)
            slots += self._slots(seq, start, start + n)
            owners += [(seq, p) for p in range(start, start + n)]
        dev = self.device
        attn = AttentionBatch(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                              num_prefill_tokens=sum(n for _, n in batch.extends))
        if batch.extends:
            seqs = [s for s, _ in batch.extends]
            counts = torch.tensor([0] + [n for _, n in batch.extends], dtype=torch.int32)
            attn.prefill_cu_seqlens_q = counts.cumsum(0, dtype=torch.int32).to(dev)
            attn.prefill_seq_lens = torch.tensor([s.num_computed_tokens + n for s, n in batch.extends],
                                                 dtype=torch.int32, device=dev)
            attn.prefill_block_table = self._block_table(seqs)
        if batch.decodes:
            attn.decode_seq_lens = torch.tensor([s.num_computed_tokens + 1 for s in batch.decodes],
                                                dtype=torch.int32, device=dev)
            attn.decode_block_table = self._block_table(batch.decodes)
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), attn, owners

    def _forward(self, batch: ScheduledBatch, input_ids, positions, attn, rows: list[int]
                 ) -> tuple[torch.Tensor, list[Checkpoint], dict[int, Checkpoint]]:
        """``(logits, checkpoints, turn_ends)`` of one step: [len(rows), vocab] fp32 logits of the
        step's token rows ``rows`` (from a captured graph for a decode-only step that fits one,
        else from the model's step), the checkpoints the step produced and each decode's turn end
        (:meth:`~kvtier.serve.hybrid_state.HybridState.ran`; none for an attention-only model)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        states = self.recurrent_state
        state_batch = states.state_batch(batch)
        attn = self.model.plan(positions, attn, self.kv_caches)  # the step's one host read of its metadata
        if (self.graphs is not None and not batch.extends
                and self.graphs.fits(len(batch.decodes), attn.decode_block_table.shape[1])):
            logits, produced = self.graphs.run(input_ids, positions, attn)[index], None
        else:
            hidden, produced = self.model.step(input_ids, positions, attn, self.kv_caches, states.slots, state_batch)
            logits = self.model.compute_logits(hidden[index])
        return logits, states.ran(batch, produced), states.turn_ends(batch)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        """Run one step; returns the logits each sequence needs, by ``seq_id``."""
        input_ids, positions, attn, owners = self.prepare(batch)
        rows, wanted = [], {}
        for row, (seq, p) in enumerate(owners):
            entry = wanted.setdefault(seq.seq_id, ([], None))
            if seq.params.prompt_logprobs and p + 1 < seq.num_prompt_tokens:
                entry[0].append((row, p))
            if p == seq.num_tokens - 1:
                wanted[seq.seq_id] = (entry[0], row)
        for prompt_rows, last in wanted.values():
            rows += [r for r, _ in prompt_rows] + ([last] if last is not None else [])
        logits, checkpoints, turn_ends = self._forward(batch, input_ids, positions, attn, rows)
        where = {r: i for i, r in enumerate(rows)}
        out = {}
        for seq_id, (prompt_rows, last) in wanted.items():
            idx = [where[r] for r, _ in prompt_rows]
            out[seq_id] = SeqLogits(
                next_token=None if last is None else logits[where[last]],
                prompt_positions=[p for _, p in prompt_rows],
                prompt_logits=logits[idx] if idx else None,
            )
        return StepResult(logits=out, checkpoints=checkpoints, turn_ends=turn_ends)
