"""Workload types: a :class:`Workload` is a list of closed-loop :class:`Session` s.

Turn ``k`` of a session is submitted ``think_time_s`` after turn ``k-1`` finished; its prompt is
described by ``block_ids``, one id per block of ``Workload.block_size`` tokens (the last block
may be partial). Equal ids mean equal token content, so the prefix structure of the source is
kept exactly; :func:`kvtier.bench.workload.prompt_token_ids` turns a turn into concrete token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KV_CACHE_TESTER = "kv-cache-tester"
MOONCAKE = "mooncake"
BUILTIN = "builtin"
MIXED = "mixed"  # a folder holding both formats

KV_DEFAULT_BLOCK_SIZE = 64  # kv-cache-tester files carry "block_size"; 64 when absent
MOONCAKE_BLOCK_SIZE = 512  # Mooncake FAST'25 README: hash_ids are 512-token blocks
STOPS = ("tool_use", "end_turn", "")

_MAX_LOCAL_ID = 2**40  # local hash ids must be in [0, 2**40); keys pack (namespace, id)


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, the line or request, and what."""


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    Attributes:
        input_tokens: prompt length in tokens after token scaling, >= 1.
        output_tokens: response length in tokens after token scaling, >= 1.
        block_ids: ``[ceil(input_tokens / block_size)]`` ints, one id per block of
            ``Workload.block_size`` tokens covering the prompt (the last may be partial).
            Ids are global in the workload; equal ids mean equal token content.
        think_time_s: seconds between the previous turn's finish and this turn's submission,
            after time scaling and capping; 0 for the first turn.
        stop: why the source response stopped: ``"tool_use"``, ``"end_turn"`` or ``""``.
        chat: the turn's text (:class:`kvtier.bench.conversations.ChatTurn`) for a text
            workload, encoded at submission; None for traces, whose prompts come from
            :func:`prompt_token_ids`.
    """

    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    think_time_s: float
    stop: str
    chat: object | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Session:
    """A closed-loop sequence of turns, e.g. ``"trace_0006"`` or ``"trace_0010/agent_001"``."""

    session_id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    """Sessions to replay plus how they were made.

    Attributes:
        name: short label (file or folder stem, or ``"builtin-seed<S>"``).
        source: the trace path, or ``"builtin"``.
        format: ``"kv-cache-tester"``, ``"mooncake"``, ``"builtin"``, or ``"mixed"`` for a
            folder holding both trace formats.
        block_size: tokens per block after scaling (smallest source block size * token_scale).
        token_scale, time_scale, max_think_s: the scaling that was applied.
        sessions: in source order (sub-agents right after their parent).
    """

    name: str
    source: str
    format: str
    block_size: int
    token_scale: float
    time_scale: float
    max_think_s: float
    sessions: tuple[Session, ...]

    def num_requests(self) -> int:
        """Total number of turns over all sessions."""
        return sum(len(s.turns) for s in self.sessions)
