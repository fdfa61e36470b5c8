"""The engine: ``step()`` = :meth:`Engine.begin_step` (schedule, start loads) -> the runner's
``run`` -> :meth:`Engine.end_step` (register computed pages, sample, finish).

Its parts: request checks (:mod:`~kvtier.serve.intake`), the scheduler, the runner, tool grammars
(:mod:`~kvtier.serve.grammar_runtime`), the sampler (:mod:`~kvtier.serve.sampler`), outputs."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from kvtier.cache.block_hash import compose_salt
from kvtier.cache.pool import KVPool
from kvtier.model.step import StepModel
from kvtier.serve.config import EngineConfig
from kvtier.serve.grammar_runtime import GrammarRuntime
from kvtier.serve.hybrid_state import cache_config, turn_end_checkpoints
from kvtier.serve.intake import Intake, request_salt
from kvtier.serve.outputs import append_token, parse, request_output
from kvtier.serve.params import RequestMetrics, RequestOutput, SamplingParams
from kvtier.serve.request import Sequence
from kvtier.serve.runner import ModelRunner, StepResult, StepRunner
from kvtier.serve.sampler import Sampler, prompt_logprobs
from kvtier.serve.scheduler import Scheduler
from kvtier.serve.stats import EngineStats
from kvtier.serve.step_plan import ScheduledBatch
from kvtier.serve.step_time import batch_features, step_features


class Engine:
    """Continuous batching over one model and its paged cache."""

    def __init__(self, model: StepModel | None, config: EngineConfig, model_id: bytes = b"", *,
                 runner: StepRunner | None = None, pool: KVPool | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """Args:
            model: K2 or a hybrid KDA + MLA model, run by a :class:`ModelRunner`; None when ``runner`` is given.
            config: sizes and policies.
            model_id: identifies the weights and compute dtype; it salts every block hash so
                that a disk cache shared by several models never serves one model's KV to another.
            runner: runs each step instead of a :class:`ModelRunner` (e.g. the simulator's timed
                runner); its ``model_config`` gives the limits requests are checked against.
            pool: the tiered pool over ``runner.kv_caches`` (built with its own copy engine, disk
                tier and clock); None = built from ``config`` over the model runner's pages.
            clock: seconds; every time in a request's metrics is read from it.

        Raises:
            ValueError: ``config`` not an EngineConfig, or not exactly one of ``model``, ``runner``.
        """
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        if (model is None) == (runner is None):
            raise ValueError("Engine needs exactly one of model= and runner=")
        if runner is None:  # the pool's config as the model's cache spec says
            config = cache_config(config, model.cache_spec())
        self.runner = runner if runner is not None else ModelRunner(model, config)
        self.config = config
        self.model_config = self.runner.model_config
        if pool is None:
            salt = compose_salt(model_id, str(model.dtype).encode()) if model is not None else model_id
            pool = KVPool(config.pool_config(salt), self.runner.kv_caches)
        self.pool = pool
        self.clock = clock
        self.scheduler = Scheduler(config, self.pool, clock=clock)
        self.intake = Intake(config, self.model_config, self.pool.config.salt)
        self.grammar = GrammarRuntime(self.model_config, self.runner.device)
        self.sampler = Sampler(torch.Generator(device=self.runner.device).manual_seed(config.seed), self.runner)
        self._pending: tuple[ScheduledBatch, object, float] | None = None  # begun step: batch, masks, start
        self._ids = itertools.count()
        self._sequences: dict[int, Sequence] = {}
        self._failed: list[Sequence] = []  # requests that failed before running (reported by the next step)
        self.num_prefill_tokens = 0  # tokens run as prefill (prompt chunks and recomputation), not decodes
        self.num_steps = 0  # steps completed (each end_step)
        self.tokenizer = None

    def attach_tokenizer(self, tokenizer) -> None:
        """Use ``tokenizer`` (a :class:`kvtier.tokenize.KimiTokenizer`) to parse every output into
        ``content``/``tool_calls`` (one streaming :class:`kvtier.toolcall.ToolCallParser` per
        request, read by :meth:`take_events` and ``RequestOutput.events``) and to build grammars
        for requests with tools (:attr:`grammar`, a :class:`~kvtier.serve.grammar_runtime.GrammarRuntime`)."""
        self.tokenizer = self.grammar.tokenizer = tokenizer

    def check_request(self, prompt_token_ids, params: SamplingParams, index: int = 0) -> list[int]:
        """The prompt as a list of ints, checked (:meth:`kvtier.serve.intake.Intake.check_request`)."""
        return self.intake.check_request(prompt_token_ids, params, index, has_tokenizer=self.tokenizer is not None)

    @property
    def block_hash_salt(self) -> bytes:
        """The salt of this engine's block hashes (model id, dtype and ``config.pool.salt``)."""
        return self.pool.config.salt

    def add_request(self, prompt_token_ids, params: SamplingParams, index: int = 0, *,
                    prompt_block_hashes: Seq[bytes] | None = None, cache_salt: str = "",
                    arrival_time: float | None = None, tool_matcher=None, checkpoint_at: Seq[int] = ()) -> int:
        """Queue one prompt; returns its request id.

        Args:
            prompt_token_ids: [num_tokens] ids: a list of ints or a 1-D integer array (an array
                is range-checked in one vectorised pass).
            params: sampling parameters.
            index: the prompt's position, for error messages.
            prompt_block_hashes: the chained hashes of the prompt's full pages: the
                :class:`kvtier.tokenize.TokenBuffer` the prompt was appended to, or a list of
                hashes, each checked as :meth:`kvtier.serve.intake.Intake.prompt_hashes` says.
            cache_salt: this request's tenant salt: requests with different salts never share
                cached blocks (hashes use ``request_salt(cache_salt)`` after the engine's salt).
            arrival_time: when the request arrived, on the engine's clock (None = now); admission
                order and TTFT count from it.
            tool_matcher: ``params.tool_grammar`` already compiled by ``grammar.compile``
                (a server compiles off the engine thread); None = compiled here.
            checkpoint_at: prompt positions (token counts) a later request comes back to, from
                the renderer (``boundaries()`` of a session encoder): a hybrid model keeps the
                recurrent state at the last page boundary at or before each, beside its prompt end.

        Raises:
            ValueError: a bad prompt (:meth:`~kvtier.serve.intake.Intake.check_request`), bad
                ``prompt_block_hashes`` (:meth:`~kvtier.serve.intake.Intake.prompt_hashes`),
                ``checkpoint_at`` not ints in [0, the prompt's length].
        """
        prompt = self.check_request(prompt_token_ids, params, index)
        at = tuple(checkpoint_at)
        if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= len(prompt) for b in at):
            raise ValueError(f"checkpoint_at: expected token counts in [0, {len(prompt)}], got {list(at)[:8]}")
        if not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        salt = request_salt(cache_salt)
        hashes = self.intake.prompt_hashes(prompt_token_ids, prompt, prompt_block_hashes, index, salt)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(next(self._ids), prompt, params, self._metrics(arrival_time), gen, checkpoint_at=at,
                       prompt_block_hashes=hashes, cache_salt=salt)
        self._sequences[seq.seq_id] = seq
        try:
            self.grammar.attach(seq, tool_matcher)
        except ValueError as e:  # a grammar llguidance rejects fails this request only
            seq.error, seq.finish_reason, seq.metrics.finish_time = f"{type(e).__name__}: {e}", "error", self.clock()
            self._failed.append(seq)
            return seq.seq_id
        self.scheduler.add(seq)
        return seq.seq_id

    def add_hashed_request(self, num_prompt_tokens: int, block_hashes: list[bytes], params: SamplingParams, *,
                           arrival_time: float | None = None) -> int:
        """Queue a prompt known only by its length and ``block_hashes`` (chained, 16 bytes each,
        at least ``(num_prompt_tokens + params.max_tokens) // page_size``: every full page the
        request will fill); returns its request id. For a runner that reads no token ids (the
        simulator's): nothing can verify the hashes, so they are trusted, unlike :meth:`add_request`'s.
        ValueError: as :meth:`kvtier.serve.intake.Intake.check_hashed` says."""
        self.intake.check_hashed(num_prompt_tokens, block_hashes, params)
        seq = Sequence(next(self._ids), None, params, self._metrics(arrival_time),
                       prompt_block_hashes=list(block_hashes), num_prompt_tokens=num_prompt_tokens)
        self._sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def _metrics(self, arrival_time: float | None) -> RequestMetrics:
        return RequestMetrics(self.clock() if arrival_time is None else arrival_time, arrival_step=self.num_steps)

    def set_resume_target(self, resume_ttft_s: float | None) -> None:
        """Serve turns that resume a session after a tool wait within ``resume_ttft_s`` seconds
        when capacity allows (None: no target): the pool plans each declared wait for it
        (:meth:`KVPool.set_resume_target`), the scheduler bounds the steps around a first token or
        an expected return (:func:`kvtier.serve.step_time.bound_step`). ValueError: not finite > 0."""
        self.pool.set_resume_target(resume_ttft_s)
        self.scheduler.set_resume_target(resume_ttft_s)

    def prefill_time_s(self, new_tokens: int, cached_tokens: int) -> float | None:
        """Estimated seconds of a step that only prefills ``new_tokens`` tokens after ``cached_tokens``
        cached ones (the scheduler's :class:`~kvtier.serve.step_time.StepTimeModel`); None before its first fit."""
        return self.scheduler.step_time.estimate_s(step_features([(new_tokens, cached_tokens)], 0, 0))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._failed)

    def stats(self) -> EngineStats:
        """The scheduler's and the pool's snapshots and this engine's counters now, as a frozen
        copy (:class:`kvtier.serve.stats.EngineStats`): what metrics and reports read. Call it on
        the thread that steps the engine; hand the result to any."""
        grammar = self.grammar.stats.snapshot() if self.grammar.stats is not None else None
        return EngineStats(self.scheduler.stats(), self.pool.stats(), self.num_prefill_tokens, self.num_steps, grammar)

    def step(self) -> list[RequestOutput]:
        """Schedule, run and postprocess one step; returns the requests that finished in it.

        ``begin_step`` -> ``runner.run`` -> ``end_step``; when nothing can run while prefix loads
        are in flight, waits up to 50 ms for them instead.
        """
        failed = [request_output(self._sequences.pop(s.seq_id), self.num_steps, self.pool.page_size) for s in self._failed]
        self._failed = []
        if not self.scheduler.has_unfinished():  # idle: nothing to run
            return failed
        batch = self.begin_step()
        if not batch:
            self.pool.wait_for_loads(timeout_s=0.05)
            return failed
        return failed + self.end_step(self.runner.run(batch))

    def begin_step(self) -> ScheduledBatch | None:
        """Schedule one step (collecting ended loads, admitting, starting loads) and start the
        tool-grammar masks of the sequences it samples; returns the batch to run, or None when
        nothing can run until prefix loads end or there is no request. RuntimeError: requests
        wait, nothing can be scheduled and nothing loads (the pool is too small for them)."""
        if not self.scheduler.has_unfinished():
            return None
        batch = self.scheduler.schedule()
        if not batch and not self.scheduler.loading:  # pages may be held by background copies: retry once
            self.pool.poll(wait=True)
            batch = self.scheduler.schedule()
        if not batch and not self.scheduler.loading:
            raise RuntimeError("no request can be scheduled: the page pool is too small for the waiting requests")
        if not batch:
            return None
        t0 = self.clock()
        self._pending = (batch, self.grammar.start_masks(batch), t0)  # masks are filled while the model runs
        return batch

    def end_step(self, result: StepResult) -> list[RequestOutput]:
        """Apply the run of the batch :meth:`begin_step` returned: each sequence advances by its
        chunk, its new full pages are registered with the pool, and sequences that reached their
        end get a token (sampled from ``result.logits`` or taken from ``result.tokens``); returns
        the requests that finished. RuntimeError: no step was begun."""
        if self._pending is None:
            raise RuntimeError("end_step without a begun step: call begin_step first")
        (batch, masks, t0), self._pending = self._pending, None
        masks = masks.result() if masks is not None else {}
        self.num_prefill_tokens += sum(n for _, n in batch.extends)
        seconds = result.seconds if result.seconds is not None else self.clock() - t0
        self.scheduler.step_time.observe(batch_features(batch), seconds)
        if batch.extends:
            self.pool.observe_prefill(batch.num_tokens, seconds)
        steps = [(s, n) for s, n in batch.extends] + [(s, 1) for s in batch.decodes]
        tokens = self._step_tokens(steps, result, masks)
        finished = []
        for seq, _ in steps:
            token = tokens.get(seq.seq_id)
            if token is None:
                continue
            try:
                if isinstance(token, Exception):
                    raise token
                done = self._append(seq, token)
            except Exception as e:  # one bad request must not stop the others
                seq.error, seq.metrics.finish_time = f"{type(e).__name__}: {e}", self.clock()
                self.scheduler.finish(seq, "error")
                self.grammar.count_cut(seq, e)
                done = True
            if done:
                finished.append(seq)
        # the step's state checkpoints, beside the blocks just indexed
        self.pool.save_checkpoints(result.checkpoints + turn_end_checkpoints(finished, result.turn_ends))
        self.num_steps += 1
        return [request_output(self._sequences.pop(seq.seq_id), self.num_steps, self.pool.page_size) for seq in finished]

    def _step_tokens(self, steps, result: StepResult, masks: dict) -> dict[int, int | Exception]:
        """Advance each ``(seq, tokens)`` of the step and read its token: taken from
        ``result.tokens`` or sampled from its logits (its prompt logprobs filled first); by
        seq_id, the token or what failed that request."""
        tokens: dict[int, int | Exception] = {}
        to_sample = []
        for seq, n in steps:
            self.scheduler.advance(seq, n)
            token, res = result.tokens.get(seq.seq_id), result.logits.get(seq.seq_id)
            try:
                prompt_logprobs(seq, res)
            except Exception as e:  # one bad request must not stop the others
                tokens[seq.seq_id] = e
                continue
            if token is not None:
                tokens[seq.seq_id] = token
            elif res is not None and res.next_token is not None:
                to_sample.append((seq, res.next_token, masks.get(seq.seq_id)))
        tokens.update(self.sampler.sample(to_sample))
        return tokens

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append ``token`` to ``seq``'s output; True (and ``seq`` finished) when it stops."""
        reason = append_token(seq, token, self.clock, self.model_config)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return reason is not None

    def sequence(self, request_id: int) -> Sequence | None:
        """The live state of an unfinished request (its ``output_token_ids`` so far,
        ``num_cached_tokens``, ``metrics``, ...), for streaming; the caller must not change it.
        None when the request is unknown or already reported by :meth:`step`."""
        return self._sequences.get(request_id)

    def take_events(self, request_id: int) -> list:
        """The tool-call parser's events of the tokens request ``request_id`` generated since the
        last call (:func:`kvtier.serve.outputs.parse`); empty when the request is unknown, already
        reported, or the engine has no tokenizer."""
        seq = self._sequences.get(request_id)
        return parse(seq) if seq is not None else []

    def abort(self, request_ids) -> None:
        """Drop unfinished requests (their pages are freed; nothing is returned for them)."""
        request_ids = set(request_ids)
        self._failed = [s for s in self._failed if s.seq_id not in request_ids]
        for rid in request_ids:
            seq = self._sequences.pop(rid, None)
            if seq is not None:
                self.scheduler.abort(seq)


__all__ = ["Engine", "request_salt"]
