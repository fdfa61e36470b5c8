"""Engine configuration (validated)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and limits of one engine.

    Attributes:
        page_size: tokens per KV page; a power of two.
        num_pages: pages per layer in the device page pool.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: sequences running at once.
        enable_prefix_caching: reuse full pages by block hash.
        seed: seed of the engine's sampling generator.

    Raises:
        ValueError: a field out of range, naming it.
    """

    page_size: int = 16
    num_pages: int = 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        ps = self.page_size
        if not isinstance(ps, int) or ps <= 0 or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two, got {ps!r}")
        for name in ("num_pages", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
