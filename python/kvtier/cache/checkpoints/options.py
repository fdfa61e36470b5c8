"""A hybrid model's checkpoint options as one record: the grid spacing and the budget of each tier.

The command line builds one :class:`CheckpointOptions` from ``--state-checkpoint-tokens`` and
``--state-{device,host,disk}-bytes``; ``kvtier bench`` and ``kvtier serve`` pass it along without
reading it, and the pool takes its fields (:meth:`CheckpointOptions.pool_fields`, the
:class:`kvtier.cache.config.PoolConfig` fields of the same names). What the options mean for a
model (its checkpoint's size, the default grid) is decided here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass

from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.options import flag, is_int

BUDGETS = ("state_device_bytes", "state_host_bytes", "state_disk_bytes")
"""The per-tier budget fields, device first."""


def default_checkpoint_tokens(checkpoint_bytes: int, kv_bytes_per_token: int, page_size: int) -> int:
    """The default grid spacing of checkpoints: the tokens whose MLA KV takes as many bytes as one
    checkpoint, rounded up to a page (so the grid at most doubles a prefix's bytes); at least one
    page. Kimi K3 (429 MiB fp32 state, 27,648 B/token): 16,896 tokens at 64-token pages."""
    tokens = -(-checkpoint_bytes // max(1, kv_bytes_per_token))
    return max(page_size, -(-tokens // page_size) * page_size)


def bytes_per_copy(checkpoint_bytes: int) -> dict[str, int]:
    """Bytes one ``checkpoint_bytes`` checkpoint takes in each tier: the device slot, a host slot
    (rounded up to 4096 bytes) and a disk file (with its 4096-byte header)."""
    return {"device": checkpoint_bytes, "host": HostTier.row_bytes(checkpoint_bytes),
            "disk": DiskTier.file_bytes(checkpoint_bytes)}


def budget_slots(name: str, value: int, per_copy: int, checkpoint_bytes: int, of: str = "") -> int:
    """Checkpoints a budget of ``value`` bytes holds at ``per_copy`` bytes each (a device slot, a
    host slot, a disk file, :func:`bytes_per_copy`); 0 for 0.

    Raises:
        ValueError: a budget that is not 0 but holds none (the message names ``name``, and the
            checkpoint's model with ``of``).
    """
    if value and value < per_copy:
        raise ValueError(f"{name}={value} is smaller than one state checkpoint{of} ({per_copy} bytes for a "
                         f"{checkpoint_bytes}-byte checkpoint): give it at least {per_copy} bytes, or 0 for no "
                         "checkpoints in that tier")
    return value // per_copy if value else 0


@dataclass(frozen=True)
class CheckpointOptions:
    """The checkpoint options of a hybrid KDA + MLA model; None = not given (the default).

    Attributes:
        state_checkpoint_tokens: tokens between the grid checkpoints a prefill saves beside those at
            prompt and turn ends; a positive multiple of the page size (None: the default,
            :func:`default_checkpoint_tokens`).
        state_device_bytes, state_host_bytes, state_disk_bytes: checkpoint budget of each tier in
            bytes, beside its KV budget (None: the tier's KV budget; 0: no checkpoints there).

    Init-only:
        page_size, page_size_name: check the grid against this page size (None: later, with
            :meth:`check`), naming it so in the error (e.g. ``--page-size 16``).

    Raises:
        ValueError: an option of the wrong type or out of range, naming its command-line option
            and what was expected.
    """

    state_checkpoint_tokens: int | None = None
    state_device_bytes: int | None = None
    state_host_bytes: int | None = None
    state_disk_bytes: int | None = None
    page_size: InitVar[int | None] = None
    page_size_name: InitVar[str | None] = None

    def __post_init__(self, page_size: int | None, page_size_name: str | None) -> None:
        self.check(page_size, page_size_name)

    @classmethod
    def from_args(cls, args, page_size: int | None = None, page_size_name: str | None = None) -> CheckpointOptions:
        """The options of an ``argparse`` namespace with the fields' attributes (as the command line
        adds them)."""
        return cls(*(getattr(args, f.name) for f in dataclasses.fields(cls)), page_size=page_size,
                   page_size_name=page_size_name)

    def check(self, page_size: int | None = None, page_size_name: str | None = None) -> CheckpointOptions:
        """Check the options (the grid against ``page_size`` tokens when given); returns them.

        Raises:
            ValueError: see the class docstring.
        """
        n = self.state_checkpoint_tokens
        if n is not None and (not is_int(n) or n < 1 or (page_size is not None and n % page_size)):
            of = page_size_name or (f"the page size ({page_size} tokens)" if page_size else "the page size")
            raise ValueError(f"{flag('state_checkpoint_tokens')} must be a positive multiple of {of}, got {n}")
        for name in BUDGETS:
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"{flag(name)} must be >= 0 bytes (0 = no checkpoints in that tier), got {value}")
        return self

    def given(self) -> list[str]:
        """The command-line options given (not None), in field order."""
        return [flag(f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def args(self) -> list[str]:
        """The command line that gives these options to another ``kvtier serve``."""
        return [a for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None
                for a in (flag(f.name), str(v))]

    def budgets(self) -> dict[str, int | None]:
        """Each tier's budget by tier name (``device``, ``host``, ``disk``)."""
        return {name.split("_")[1]: getattr(self, name) for name in BUDGETS}

    def check_model(self, checkpoint_bytes: int, model: str) -> None:
        """Check the options against a model whose checkpoint is ``checkpoint_bytes`` (0: a model
        without recurrent state), before anything runs.

        Raises:
            ValueError: an option given for a model without recurrent state; a budget that is not 0
                and smaller than one checkpoint in its tier (naming the option and the floor).
        """
        if not checkpoint_bytes and self.given():
            raise ValueError(f"{', '.join(self.given())} apply to hybrid KDA + MLA models only (recurrent-state "
                             f"checkpoints); model {model!r} has none")
        floors = bytes_per_copy(checkpoint_bytes)
        for tier, value in self.budgets().items() if checkpoint_bytes else ():
            budget_slots(flag(f"state_{tier}_bytes"), value, floors[tier], checkpoint_bytes, f" of model {model!r}")

    def grid_tokens(self, checkpoint_bytes: int, kv_bytes_per_token: int, page_size: int) -> int:
        """The grid spacing in tokens: the option, else :func:`default_checkpoint_tokens`."""
        return self.state_checkpoint_tokens or default_checkpoint_tokens(checkpoint_bytes, kv_bytes_per_token,
                                                                         page_size)

    def pool_fields(self) -> dict[str, int | None]:
        """The :class:`kvtier.cache.config.PoolConfig` fields these options set (a grid not given
        is 0 there: the default)."""
        return dataclasses.asdict(self) | {"state_checkpoint_tokens": self.state_checkpoint_tokens or 0}


__all__ = ["BUDGETS", "CheckpointOptions", "budget_slots", "bytes_per_copy", "default_checkpoint_tokens"]
