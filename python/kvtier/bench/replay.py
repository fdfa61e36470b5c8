"""Closed-loop replay of agent sessions through one engine, in real time.

The closed loop itself (sessions, think times, ramp, tool waits, records) is
:class:`kvtier.bench.closed_loop.ClosedLoop`, shared with the simulator; here its target is one
real engine: it steps while it has work, and when every active session is thinking the loop
sleeps until the next turn is due.

A text workload (:mod:`kvtier.bench.conversations`) is encoded at submission by one
:class:`~kvtier.tokenize.SessionEncoder` per session, with the engine's page size and hash
salt, so TTFT includes the incremental encode and the prefix lookup gets the token buffer's
block hashes. A token workload gets synthetic prompts (:func:`kvtier.bench.workload.prompt_token_ids`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.bench.closed_loop import TOOL_WAIT_P50_S, ActiveSession, ClosedLoop, run_result, working_set_pages
from kvtier.bench.records import ConfigRun, RequestRecord
from kvtier.bench.workload import Turn, Workload, prompt_token_ids
from kvtier.serve.engine import Engine
from kvtier.serve.params import RequestOutput, SamplingParams
from kvtier.tokenize import KimiTokenizer, SessionEncoder

__all__ = ["TOOL_WAIT_P50_S", "replay", "working_set_pages"]

_TOKEN_LOW = 256  # synthetic prompt ids start here (clear of byte-level ids; any id is valid)


@dataclass
class _Prompt:
    """A session's last prompt and, for a text workload, its incremental encoder."""

    ids: list[int] | None = None
    encoder: SessionEncoder | None = None


class _EngineTarget:
    """One real engine as the closed loop's target (wall clock)."""

    def __init__(self, engine: Engine, workload: Workload, tokenizer: KimiTokenizer | None, keep_outputs: bool,
                 clock: Callable[[], float], sleep: Callable[[float], None]):
        self.engine, self.block_size, self.tokenizer = engine, workload.block_size, tokenizer
        self.keep_outputs, self.clock, self.sleep = keep_outputs, clock, sleep
        self.by_request: dict[int, ActiveSession] = {}
        self.steps = self.running = 0  # steps that ran a sequence, and the sequences they ran

    @property
    def mean_running_batch(self) -> float | None:
        """Sequences per step (running after the step plus those it finished), over the steps
        that ran any; None before one did."""
        return self.running / self.steps if self.steps else None

    def submit(self, a: ActiveSession, turn: Turn, arrival_time: float) -> None:
        params = SamplingParams(max_tokens=turn.output_tokens, temperature=0.0, ignore_eos=True,
                                logprobs=self.keep_outputs)
        p = a.state = a.state or _Prompt()
        hashes = None
        if turn.chat is None:
            p.ids = prompt_token_ids(turn, self.block_size, self.engine.model_config.vocab_size, low=_TOKEN_LOW)
        else:
            if p.encoder is None:
                p.encoder = SessionEncoder(self.tokenizer, page_size=self.engine.config.pool.page_size,
                                           salt=self.engine.block_hash_salt)
            p.encoder.append(list(turn.chat.messages), list(turn.chat.tools) if turn.chat.tools else None)
            buf = p.encoder.token_buffer  # hashed as appended: the engine reads, never re-hashes
            p.ids, hashes = p.encoder.ids, (buf if buf is not None else p.encoder.block_hashes())
        rid = self.engine.add_request(p.ids, params, prompt_block_hashes=hashes, arrival_time=arrival_time)
        self.by_request[rid] = a

    def advance(self, until: float | None) -> list[tuple[ActiveSession, RequestOutput]] | None:
        if self.engine.has_unfinished():
            outs = self.engine.step()
            ran = self.engine.scheduler.stats().running + len(outs)
            if ran:
                self.steps, self.running = self.steps + 1, self.running + ran
            return [(self.by_request.pop(out.request_id), out) for out in outs]
        if until is None:
            return None
        self.sleep(max(0.0, until - self.clock()))
        return []

    def tool_wait(self, a: ActiveSession, expected_wait_s: float) -> None:
        self.engine.pool.tool_wait(a.session.session_id, a.state.ids, expected_wait_s)

    def tool_return(self, a: ActiveSession) -> None:
        self.engine.pool.tool_return(a.session.session_id)


def replay(engine: Engine, workload: Workload, name: str, *, concurrency: int, tool_aware: bool = False,
           keep_outputs: bool = False, ramp_s: float = 0.0, on_finish: Callable[[RequestRecord], None] | None = None,
           tokenizer: KimiTokenizer | None = None,
           clock: Callable[[], float] = time.perf_counter,
           sleep: Callable[[float], None] = time.sleep, declared_waits: bool = False) -> ConfigRun:
    """Replay ``workload`` through ``engine``; returns the run's records and counters.

    Args:
        engine: a fresh engine (its pool counters are reported as this run's).
        workload: sessions to replay, in order.
        name: the configuration's name, copied into the result.
        concurrency: sessions active at once (>= 1).
        tool_aware: tell the pool about tool waits (see the module docstring).
        keep_outputs: keep each request's generated tokens and logprobs in its record.
        ramp_s: seconds over which the first ``concurrency`` sessions start (see the module
            docstring); 0 starts them together.
        on_finish: called with each request's record as it finishes (progress display).
        tokenizer: encodes the turns of a text workload (required when a turn has ``chat``).
        clock, sleep: time source and sleep, in seconds (tests may pass fakes).
        declared_waits: with ``tool_aware``, the pool hears each wait's recorded length (a client
            that declares it) instead of the running median
            (:class:`~kvtier.bench.closed_loop.ClosedLoop`).

    Raises:
        ValueError: ``concurrency`` < 1, ``ramp_s`` < 0, or a text workload without ``tokenizer``.

    A turn the engine refuses (e.g. a prompt longer than the model's context) is recorded
    with its error and the session goes on with its next turn.
    """
    if tokenizer is None and any(t.chat is not None for s in workload.sessions for t in s.turns):
        raise ValueError("a text workload needs tokenizer= (a KimiTokenizer) to encode its turns")
    target = _EngineTarget(engine, workload, tokenizer, keep_outputs, clock, sleep)
    loop = ClosedLoop(workload, target, clock, concurrency=concurrency, ramp_s=ramp_s, tool_aware=tool_aware,
                      keep_outputs=keep_outputs, on_finish=on_finish, declared_waits=declared_waits)
    wall_s = loop.run()
    run = run_result(name, loop, wall_s, workload, [engine])
    run.mean_running_batch = target.mean_running_batch
    return run
