"""Per-sequence recurrent state of the hybrid models' KDA layers, in slots beside the KV pages.

A sequence of a hybrid model (:mod:`kvtier.model.kimi_linear`) carries, per KDA layer, a
``[heads, head_dim, head_dim]`` recurrent state and the last ``kernel - 1`` inputs of the short
convolution. Unlike MLA KV, this is a fixed size per sequence, whatever its length, so it lives in
a slot pool: ``[num_slots, ...]`` tensors per KDA layer, addressed by one slot id per sequence. The
engine owns the pool (as it owns the page pool), allocates a slot when a sequence starts and frees
it when the sequence ends; the model's forward reads and writes the rows the step's
:class:`StateBatch` names.

Bytes per slot (K3, 69 KDA layers of 96 x 128 x 128 fp32 plus 3 x 12,288 x 3 conv inputs in
bf16): 414 MiB + 14.6 MiB (``KimiLinearConfig.state_bytes_per_sequence``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.model.kimi_linear_config import KimiLinearConfig


STATE_DTYPE = torch.float32
"""The recurrent states' dtype in a running model's slots (the KDA kernels keep them in fp32)."""


class StateSlots:
    """Slot pool of KDA states: per KDA layer ``recurrent[i]`` [num_slots, H, K, K] and
    ``conv[i]`` [num_slots, conv_dim, kernel - 1], ``i`` counting KDA layers in model order.

    Args:
        config: the hybrid model's config (heads, head_dim, conv width, KDA layer count).
        num_slots: how many sequences can hold a state at once.
        state_dtype: dtype of the recurrent states (fp32 by default, as the KDA kernels keep them).
        conv_dtype: dtype of the conv windows (the model's activation dtype).
        device: where the tensors live.

    Raises:
        ValueError: ``num_slots`` < 1.
    """

    def __init__(self, config: KimiLinearConfig, num_slots: int, *, state_dtype: torch.dtype = STATE_DTYPE,
                 conv_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        c = config
        n_layers = len(c.kda_layers)
        h, d = c.linear_num_heads, c.linear_head_dim
        self.num_slots = num_slots
        self.recurrent = [torch.zeros(num_slots, h, d, d, dtype=state_dtype, device=device) for _ in range(n_layers)]
        self.conv = [torch.zeros(num_slots, c.conv_dim, c.short_conv_kernel_size - 1, dtype=conv_dtype, device=device)
                     for _ in range(n_layers)]
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot id, its state zeroed (a fresh sequence). Raises RuntimeError when none is free."""
        if not self._free:
            raise RuntimeError(f"no free state slot (all {self.num_slots} in use)")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the pool. Raises ValueError for an id out of range or already free."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot must be an allocated slot id in [0, {self.num_slots}), got {slot}")
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Zero ``slot``'s state in every layer (the state before a sequence's first token)."""
        for t in (*self.recurrent, *self.conv):
            t[slot].zero_()

    def load(self, slot: int, checkpoint: StateCheckpoints, row: int) -> None:
        """Set ``slot``'s state to checkpoint ``row`` of ``checkpoint`` (resume a sequence from a
        saved boundary)."""
        for i, (rec, conv) in enumerate(zip(self.recurrent, self.conv, strict=True)):
            rec[slot].copy_(checkpoint.recurrent[i, row])
            conv[slot].copy_(checkpoint.conv[i, row])

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one slot's state as :meth:`pack` lays it out."""
        return sum(t[0].numel() * t.element_size() for t in (*self.recurrent, *self.conv))

    def pack(self, slot: int) -> torch.Tensor:
        """``slot``'s state as one ``[checkpoint_bytes]`` uint8 tensor on the slots' device: per KDA
        layer its recurrent state then its conv window, each in its own dtype's bytes (what the
        pool keeps as a checkpoint, :mod:`kvtier.cache.checkpoints.store`)."""
        return _pack([r[slot] for r in self.recurrent], [c[slot] for c in self.conv])

    def pack_into(self, slot: int, out: torch.Tensor) -> torch.Tensor:
        """:meth:`pack` written into ``out`` (``[checkpoint_bytes]`` uint8, on any device: a
        preallocated row, e.g. in host memory) instead of a new tensor; returns ``out``.
        ValueError: ``out`` is not ``checkpoint_bytes`` uint8 bytes."""
        if out.dtype != torch.uint8 or out.numel() != self.checkpoint_bytes:
            raise ValueError(f"out must be {self.checkpoint_bytes} uint8 bytes, got {out.numel()} {out.dtype}")
        at = 0
        for r, c in zip(self.recurrent, self.conv, strict=True):
            for part in (r[slot], c[slot]):
                raw = part.contiguous().view(-1).view(torch.uint8)
                out[at:at + raw.numel()].copy_(raw)
                at += raw.numel()
        return out

    def pack_checkpoint(self, checkpoints: StateCheckpoints, row: int) -> torch.Tensor:
        """Row ``row`` of ``checkpoints`` (a forward's states at a boundary) laid out as :meth:`pack`
        lays out a slot, each part cast to the slots' dtype."""
        rd, cd = self.recurrent[0].dtype, self.conv[0].dtype
        return _pack([r.to(rd) for r in checkpoints.recurrent[:, row]], [c.to(cd) for c in checkpoints.conv[:, row]])

    def unpack(self, slot: int, payload: torch.Tensor) -> None:
        """Set ``slot``'s state from ``payload`` (as :meth:`pack` makes it; any device).

        Raises:
            ValueError: ``payload`` is not ``checkpoint_bytes`` uint8 bytes.
        """
        if payload.dtype != torch.uint8 or payload.numel() != self.checkpoint_bytes:
            raise ValueError(f"payload must be {self.checkpoint_bytes} uint8 bytes (a state checkpoint of this "
                             f"model), got {payload.numel()} {payload.dtype}")
        payload = payload.to(self.recurrent[0].device).reshape(-1)
        at = 0
        for rec, conv in zip(self.recurrent, self.conv, strict=True):
            for t in (rec[slot], conv[slot]):
                n = t.numel() * t.element_size()
                t.copy_(payload[at:at + n].view(t.dtype).view(t.shape))
                at += n

    def snapshot(self, slot: int) -> StateCheckpoints:
        """A copy of ``slot``'s state in every layer as a one-row :class:`StateCheckpoints`."""
        return StateCheckpoints(torch.stack([r[slot] for r in self.recurrent])[:, None].clone(),
                                torch.stack([c[slot] for c in self.conv])[:, None].clone())


@dataclass
class StateBatch:
    """Which state slot each sequence of a step reads and writes, and which states to hand back.

    Sequences are in the step's order (:class:`kvtier.model.AttentionBatch`): extend (prefill)
    sequences first, then decoding ones.

    Attributes:
        prefill_slots: [P] int32 slot of each extend sequence: its chunk starts from the slot's
            state (zeros for a fresh sequence: :meth:`StateSlots.allocate` zeroes it) and the slot
            holds the state after its last new token when the step ends.
        decode_slots: [D] int32 slot of each decoding sequence (updated in place).
        checkpoint_seq, checkpoint_len: [n] int32 each, or None: row i asks for the state of extend
            sequence ``checkpoint_seq[i]`` after its first ``checkpoint_len[i]`` new tokens of this
            step (0 = the state it started from); returned by the forward as
            :class:`StateCheckpoints`.
    """

    prefill_slots: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    checkpoint_seq: torch.Tensor | None = None
    checkpoint_len: torch.Tensor | None = None

    @property
    def num_checkpoints(self) -> int:
        return 0 if self.checkpoint_seq is None else int(self.checkpoint_seq.numel())


@dataclass
class StateCheckpoints:
    """States handed back at caller-named token boundaries, for every KDA layer.

    Attributes:
        recurrent: [num_kda_layers, n, H, K, K] fp32.
        conv: [num_kda_layers, n, conv_dim, kernel - 1] (the conv window at the boundary: the last
            kernel - 1 inputs of the convolution, oldest first).
    """

    recurrent: torch.Tensor
    conv: torch.Tensor


def _pack(recurrent: list[torch.Tensor], conv: list[torch.Tensor]) -> torch.Tensor:
    parts = []
    for r, c in zip(recurrent, conv, strict=True):
        parts += [r.contiguous().view(-1).view(torch.uint8), c.contiguous().view(-1).view(torch.uint8)]
    return torch.cat(parts)
