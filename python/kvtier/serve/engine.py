"""The engine: ``step()`` = :meth:`Engine.begin_step` (schedule, start loads) -> the runner's
``run`` -> :meth:`Engine.end_step` (register computed pages, sample, finish)."""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvtier import ops
from kvtier.model.kimi_k2 import KimiK2ForCausalLM
from kvtier.cache.block_hash import BLOCK_HASH_BYTES, block_hashes, compose_salt
from kvtier.cache.pool import KVPool
from kvtier.options import is_int
from kvtier.serve.config import EngineConfig
from kvtier.serve.params import RequestMetrics, RequestOutput, SamplingParams
from kvtier.serve.penalties import apply_penalties
from kvtier.serve.request import Sequence
from kvtier.serve.runner import ModelRunner, StepResult, StepRunner
from kvtier.serve.scheduler import ScheduledBatch, Scheduler
from kvtier.serve.stats import EngineStats
from kvtier.serve.step_time import batch_features, step_features
from kvtier.tokenize.buffer import TokenBuffer


class Engine:
    """Continuous batching over one model and its paged cache."""

    def __init__(self, model: KimiK2ForCausalLM | None, config: EngineConfig, model_id: bytes = b"", *,
                 runner: StepRunner | None = None, pool: KVPool | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """Args:
            model: the model, run by a :class:`ModelRunner`; None when ``runner`` is given.
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
        self.config = config
        self.runner = runner if runner is not None else ModelRunner(model, config)
        self.model_config = self.runner.model_config
        if pool is None:
            salt = compose_salt(model_id, str(model.dtype).encode()) if model is not None else model_id
            pool = KVPool(config.pool_config(salt), self.runner.kv_caches)
        self.pool = pool
        self.clock = clock
        self.scheduler = Scheduler(config, self.pool, clock=clock)
        self._pending: tuple[ScheduledBatch, object, float] | None = None  # begun step: batch, masks, start
        self.generator = torch.Generator(device=self.runner.device).manual_seed(config.seed)
        self._ids = itertools.count()
        self._sequences: dict[int, Sequence] = {}
        self._failed: list[Sequence] = []  # requests that failed before running (reported by the next step)
        self.num_prefill_tokens = 0  # tokens run as prefill (prompt chunks and recomputation), not decodes
        self.num_steps = 0  # steps completed (each end_step)
        self.tokenizer = None
        self.grammar_limits = None  # kvtier.toolcall.GrammarLimits (None: its defaults); set before the first tools request
        self.grammar_stats = None  # kvtier.toolcall.GrammarStats, with the compiler
        self._tool_compiler = None  # kvtier.toolcall.GrammarCompiler, built on the first request with tools
        self._tool_lock = threading.Lock()
        self._token_table = None
        self._mask_thread: ThreadPoolExecutor | None = None
        self._mask_executor = None  # llguidance.LLExecutor

    def _sample_backend(self) -> str:
        """The sampling op's backend: the model's current one (``set_backend`` may change it);
        ``torch`` for a runner without a model (the simulator's)."""
        model = getattr(self.runner, "model", None)
        return model.backend if model is not None else "torch"

    def attach_tokenizer(self, tokenizer) -> None:
        """Use ``tokenizer`` (a :class:`kvtier.tokenize.KimiTokenizer`) to parse every output into
        ``content``/``tool_calls`` (one streaming :class:`kvtier.toolcall.ToolCallParser` per
        request, read by :meth:`take_events` and ``RequestOutput.events``) and to build grammars
        for requests with tools."""
        self.tokenizer = tokenizer

    def grammar_compiler(self):
        """The :class:`kvtier.toolcall.GrammarCompiler` of this engine's tokenizer under
        :attr:`grammar_limits` (built on first use, about a second; thread-safe: a server
        compiles requests' grammars with it on its request threads)."""
        with self._tool_lock:
            if self._tool_compiler is None:
                import llguidance

                from kvtier.toolcall import GrammarCompiler, GrammarLimits, GrammarStats, TokenTable

                if self.tokenizer is None:
                    raise ValueError("tools need a tokenizer: call Engine.attach_tokenizer(tokenizer) first")
                eot = [self.tokenizer.token_id("<|im_end|>"), *self.model_config.eos_token_id]
                self.grammar_limits = self.grammar_limits or GrammarLimits()
                self.grammar_stats = GrammarStats()
                compiler = GrammarCompiler(self.tokenizer, eot, limits=self.grammar_limits, stats=self.grammar_stats)
                self._token_table = TokenTable(self.tokenizer, compiler.end_of_turn_ids)
                self._mask_executor = llguidance.LLExecutor()
                self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-masks")
                self._tool_compiler = compiler
            return self._tool_compiler

    def compile_tool_grammar(self, params: SamplingParams):
        """A fresh ``llguidance.LLMatcher`` of ``params.tool_grammar`` for :meth:`add_request`'s
        ``tool_matcher`` (thread-safe: call it off the engine thread; cached by grammar).

        Raises:
            GrammarError: the grammar does not compile or exceeds a limit; the message and
                ``path`` name the tool and schema keyword at fault when found.
        """
        try:
            return self.grammar_compiler().matcher(params.tool_grammar, params.tool_specs)
        except ValueError:
            self.grammar_stats.add(cut_compile=1)
            raise

    def _tool_constraint(self, params: SamplingParams, matcher=None):
        """A fresh constraint for ``params.tool_grammar`` over ``matcher`` (None: compiled here)."""
        from kvtier.toolcall import ToolCallConstraint

        if matcher is None:
            matcher = self.compile_tool_grammar(params)
        return ToolCallConstraint(matcher, self._token_table, params.max_tokens, self.grammar_limits,
                                  self.grammar_stats)

    def check_request(self, prompt_token_ids, params: SamplingParams, index: int = 0) -> list[int]:
        """The prompt as a list of Python ints, after checking it fits this engine.

        Raises:
            ValueError: an empty prompt, a token id outside [0, vocab_size), a prompt longer than
            max_position_embeddings, or one that cannot fit in the page pool; the message names
            ``prompt_token_ids[index]``.
        """
        vocab = self.model_config.vocab_size
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params[{index}] must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_token_ids, (str, bytes, dict)) or not isinstance(prompt_token_ids, Iterable) or (
                isinstance(prompt_token_ids, (np.ndarray, torch.Tensor)) and prompt_token_ids.ndim != 1):
            raise ValueError(f"prompt_token_ids[{index}] must be a list of ints or a 1-D integer array, got "
                             f"{type(prompt_token_ids).__name__}")
        prompt = _checked_int_array(prompt_token_ids, vocab)
        if prompt is None:  # not an in-range integer array: check (and name) each id
            prompt = [_as_int(t) for t in prompt_token_ids]
            for j, t in enumerate(prompt):
                if not is_int(t) or not 0 <= t < vocab:
                    raise ValueError(f"prompt_token_ids[{index}][{j}] = {t!r} must be an int in [0, vocab_size={vocab})")
        self._check_fits(len(prompt), params, f"prompt_token_ids[{index}]")
        if params.tool_grammar is not None and self.tokenizer is None:
            raise ValueError(f"sampling_params[{index}].tools needs a tokenizer: build the engine through "
                             "LLM(..., tokenizer=DIR) or call Engine.attach_tokenizer(tokenizer)")
        return prompt

    def _check_fits(self, num_tokens: int, params: SamplingParams, where: str) -> None:
        """Raise ValueError (naming ``where``) when a prompt of ``num_tokens`` tokens is empty, longer
        than the context, or with its output cannot fit in the page pool."""
        max_pos = self.model_config.max_position_embeddings
        if num_tokens == 0:
            raise ValueError(f"{where} is empty; a prompt needs at least one token")
        if num_tokens > max_pos:
            raise ValueError(f"{where} has {num_tokens} tokens, more than max_position_embeddings={max_pos}")
        if params.refuse_past_context and num_tokens + params.max_tokens > max_pos:  # sampling-parameter plumbing
            raise ValueError(f"max_tokens: {where} has {num_tokens} tokens and max_tokens is {params.max_tokens}: "
                             f"{num_tokens + params.max_tokens} tokens in all, more than the context "
                             f"(max_position_embeddings={max_pos}); lower max_tokens or shorten the prompt")
        ps = self.config.pool.page_size
        pages = -(-(min(num_tokens + params.max_tokens, max_pos) - 1) // ps)  # the last token is never cached
        if pages > self.config.pool.num_device_pages:
            raise ValueError(f"{where} with max_tokens={params.max_tokens} needs {pages} pages of "
                             f"{ps} tokens, more than num_device_pages={self.config.pool.num_device_pages}")

    @property
    def block_hash_salt(self) -> bytes:
        """The salt of this engine's block hashes (model id, dtype and ``config.pool.salt``)."""
        return self.pool.config.salt

    def add_request(self, prompt_token_ids, params: SamplingParams, index: int = 0, *,
                    prompt_block_hashes: Seq[bytes] | None = None, cache_salt: str = "",
                    arrival_time: float | None = None, tool_matcher=None) -> int:
        """Queue one prompt; returns its request id.

        Args:
            prompt_token_ids: [num_tokens] ids: a list of ints or a 1-D integer array (an array
                is range-checked in one vectorised pass).
            params: sampling parameters.
            index: the prompt's position, for error messages.
            prompt_block_hashes: the chained hashes of the prompt's full pages, either

                - the :class:`kvtier.tokenize.TokenBuffer` the prompt was appended to (a session
                  encoder's, see :func:`kvtier.serve.chat.new_encoder`): its hashes were computed
                  by the buffer from its own ids as they were appended, so they are taken without
                  hashing again once its ids equal the prompt (one compare of the ids), its
                  ``page_size`` is the pool's and its ``salt`` is :attr:`block_hash_salt` +
                  ``request_salt(cache_salt)``; or
                - a list of hashes from elsewhere (``block_hashes(prompt, page_size,
                  salt=block_hash_salt + request_salt(cache_salt))[:n]``, ``n <= len(prompt) //
                  page_size``). The engine never serves a block by a hash it has not verified:
                  such a chain is recomputed from the prompt (one native pass, GIL released,
                  about 1 ms per 100K tokens at page_size 64) and compared, so a chain built with
                  another salt, page size or prompt, or one whose earlier hashes were swapped for
                  another tenant's, is rejected.

                Either way the pool gets them and hashes only the blocks past them (the output's).
            cache_salt: this request's tenant salt: requests with different salts never share
                cached blocks (hashes use ``request_salt(cache_salt)`` after the engine's salt).
            arrival_time: when the request arrived, on the engine's clock (None = now); admission
                order and TTFT count from it.
            tool_matcher: ``params.tool_grammar`` already compiled by :meth:`compile_tool_grammar`
                (a server compiles off the engine thread); None = compiled here.

        Raises:
            ValueError: a bad prompt (see :meth:`check_request`) or ``prompt_block_hashes`` that
                are too many, not 16-byte ``bytes``, or do not match the prompt (a token buffer:
                other ids, another page size or another salt).
        """
        prompt = self.check_request(prompt_token_ids, params, index)
        if not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        salt = request_salt(cache_salt)
        if prompt_block_hashes is None:
            hashes = []
        elif isinstance(prompt_block_hashes, TokenBuffer):
            hashes = self._buffer_hashes(prompt_token_ids, prompt_block_hashes, index, salt)
        else:
            hashes = self._checked_hashes(prompt, prompt_block_hashes, index, salt)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(next(self._ids), prompt, params, self._metrics(arrival_time), gen,
                       prompt_block_hashes=hashes, cache_salt=salt)
        self._sequences[seq.seq_id] = seq
        if self.tokenizer is not None:
            from kvtier.toolcall import ToolCallParser

            seq.parser = ToolCallParser.for_tokenizer(self.tokenizer)
        if params.tool_grammar is not None:
            try:
                seq.constraint = self._tool_constraint(params, tool_matcher)
            except ValueError as e:  # a grammar llguidance rejects fails this request only
                seq.error = f"{type(e).__name__}: {e}"
                seq.finish_reason = "error"
                seq.metrics.finish_time = self.clock()
                self._failed.append(seq)
                return seq.seq_id
        self.scheduler.add(seq)
        return seq.seq_id

    def add_hashed_request(self, num_prompt_tokens: int, block_hashes: list[bytes], params: SamplingParams, *,
                           arrival_time: float | None = None) -> int:
        """Queue a prompt known only by its length and block hashes; returns its request id.

        For a runner that reads no token ids (the simulator's timed runner): the pool finds and
        indexes blocks by ``block_hashes`` alone, so they must cover every full page the request
        will fill, prompt and output. Nothing can verify them (there are no tokens): they are
        trusted, unlike :meth:`add_request`'s.

        Args:
            num_prompt_tokens: prompt length in tokens.
            block_hashes: chained 16-byte hashes, at least ``(num_prompt_tokens +
                params.max_tokens) // page_size``.
            params: sampling parameters (no tool grammar, no logprobs: there are no logits).
            arrival_time: when it arrived, on the engine's clock (None = now).

        Raises:
            ValueError: the prompt does not fit (as :meth:`check_request`), too few hashes, or
                ``params`` asks for logprobs or a tool grammar.
        """
        where = f"prompt of {num_prompt_tokens} tokens"
        self._check_fits(num_prompt_tokens, params, where)
        need = (num_prompt_tokens + params.max_tokens) // self.config.pool.page_size
        if len(block_hashes) < need:
            raise ValueError(f"{where}: block_hashes has {len(block_hashes)} hashes; its {need} full pages of "
                             f"page_size={self.config.pool.page_size} (prompt and max_tokens) need one each")
        if params.logprobs or params.prompt_logprobs or params.tool_grammar is not None:
            raise ValueError(f"{where}: a request without token ids has no logprobs or tool grammar")
        seq = Sequence(next(self._ids), None, params, self._metrics(arrival_time),
                       prompt_block_hashes=list(block_hashes), num_prompt_tokens=num_prompt_tokens)
        self._sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def _metrics(self, arrival_time: float | None) -> RequestMetrics:
        return RequestMetrics(self.clock() if arrival_time is None else arrival_time, arrival_step=self.num_steps)

    def _buffer_hashes(self, prompt_token_ids, buf: TokenBuffer, index: int, salt: bytes) -> list[bytes]:
        """The hashes ``buf`` keeps, after the checks :meth:`add_request` documents (no hashing:
        the native buffer hashed each page once, as its ids were appended)."""
        try:
            return buf.chain_for(prompt_token_ids, self.config.pool.page_size, self.block_hash_salt + salt)
        except ValueError as e:
            raise ValueError(f"prompt_block_hashes for prompt {index}: {e} (a TokenBuffer built for another "
                             "engine, tenant or prompt?)") from None

    def _checked_hashes(self, prompt: list[int], hashes: Seq[bytes], index: int, salt: bytes = b"") -> list[bytes]:
        """``hashes`` as a list after the checks :meth:`add_request` documents."""
        where = f"prompt_block_hashes for prompt {index}"
        if isinstance(hashes, (bytes, bytearray, str)) or not isinstance(hashes, Seq):
            raise ValueError(f"{where}: expected a list of {BLOCK_HASH_BYTES}-byte hashes, got {type(hashes).__name__}")
        hashes = list(hashes)
        ps, n = self.config.pool.page_size, len(hashes)
        if n > len(prompt) // ps:
            raise ValueError(f"{where}: {n} hashes for a prompt of {len(prompt)} tokens; at most "
                             f"{len(prompt) // ps} full pages of page_size={ps}")
        if n == 0:
            return hashes
        if not all(isinstance(h, bytes) and len(h) == BLOCK_HASH_BYTES for h in hashes):
            raise ValueError(f"{where}: each hash must be {BLOCK_HASH_BYTES} bytes")
        own = block_hashes(prompt[:n * ps], ps, None, self.block_hash_salt + salt)
        if own != hashes:
            bad = next(i for i, (a, b) in enumerate(zip(own, hashes)) if a != b)
            raise ValueError(f"{where}: hash {bad} does not match the prompt's page {bad} with page_size={ps} "
                             "and this engine's block_hash_salt (a TokenBuffer built for another engine, or "
                             "another prompt?)")
        return own

    def set_resume_target(self, resume_ttft_s: float | None) -> None:
        """Serve turns that resume a session after a tool wait within ``resume_ttft_s`` seconds
        when capacity allows (None: no target): the pool plans each declared wait for it
        (:meth:`KVPool.set_resume_target`) and the scheduler keeps the steps around a first token
        or an expected return short (:meth:`Scheduler.bound_step`).

        Raises:
            ValueError: a target that is not a finite number > 0.
        """
        self.pool.set_resume_target(resume_ttft_s)
        self.scheduler.set_resume_target(resume_ttft_s)

    def prefill_time_s(self, new_tokens: int, cached_tokens: int) -> float | None:
        """Estimated seconds of a step that only prefills ``new_tokens`` tokens after
        ``cached_tokens`` cached ones (the scheduler's step-time model,
        :class:`~kvtier.serve.step_time.StepTimeModel`); None before its first fit."""
        return self.scheduler.step_time.estimate_s(step_features([(new_tokens, cached_tokens)], 0, 0))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._failed)

    def stats(self) -> EngineStats:
        """The scheduler's and the pool's snapshots and this engine's counters now, as a frozen
        copy (:class:`kvtier.serve.stats.EngineStats`) that later steps never change: what metrics
        and reports read. Call it on the thread that steps the engine; hand the result to any."""
        grammar = self.grammar_stats.snapshot() if self.grammar_stats is not None else None
        return EngineStats(self.scheduler.stats(), self.pool.stats(), self.num_prefill_tokens, self.num_steps, grammar)

    def step(self) -> list[RequestOutput]:
        """Schedule, run and postprocess one step; returns the requests that finished in it.

        ``begin_step`` -> ``runner.run`` -> ``end_step``; when nothing can run while prefix loads
        are in flight, waits up to 50 ms for them instead.
        """
        failed = [self._output(self._sequences.pop(s.seq_id)) for s in self._failed]
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
        nothing can run until prefix loads end or there is no request.

        Raises:
            RuntimeError: requests wait, nothing can be scheduled and nothing is loading (the page
                pool is too small for the waiting requests).
        """
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
        self._pending = (batch, self._start_masks(batch), t0)  # masks are filled while the model runs
        return batch

    def end_step(self, result: StepResult) -> list[RequestOutput]:
        """Apply the run of the batch :meth:`begin_step` returned: each sequence advances by its
        chunk, its new full pages are registered with the pool, and sequences that reached their
        end get a token (sampled from ``result.logits`` or taken from ``result.tokens``); returns
        the requests that finished.

        Raises:
            RuntimeError: no step was begun.
        """
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
        tokens: dict[int, int | Exception] = {}  # by seq_id: the step's token, or what failed it
        to_sample = []
        for seq, n in steps:
            self.scheduler.advance(seq, n)
            token, res = result.tokens.get(seq.seq_id), result.logits.get(seq.seq_id)
            try:
                self._prompt_logprobs(seq, res)
            except Exception as e:  # one bad request must not stop the others
                tokens[seq.seq_id] = e
                continue
            if token is not None:
                tokens[seq.seq_id] = token
            elif res is not None and res.next_token is not None:
                to_sample.append((seq, res.next_token, masks.get(seq.seq_id)))
        tokens.update(self._sample(to_sample))
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
                seq.error = f"{type(e).__name__}: {e}"
                seq.metrics.finish_time = self.clock()
                self.scheduler.finish(seq, "error")
                self._count_cut(seq, e)
                done = True
            if done:
                finished.append(seq)
        self.num_steps += 1
        return [self._output(self._sequences.pop(seq.seq_id)) for seq in finished]

    def _count_cut(self, seq: Sequence, e: Exception) -> None:
        """Count a constrained request its grammar ended: a missed deadline, or an llguidance
        limit while decoding (the only way a masked matcher fails)."""
        if seq.constraint is None or self.grammar_stats is None:
            return
        from kvtier.toolcall import GrammarError

        if isinstance(e, GrammarError):
            deadline = "GrammarLimitError" in str(e) or type(e).__name__ == "GrammarLimitError"
            self.grammar_stats.add(**{"cut_deadline" if deadline else "cut_parser": 1})

    def sequence(self, request_id: int) -> Sequence | None:
        """The live state of an unfinished request (its ``output_token_ids`` so far,
        ``num_cached_tokens``, ``metrics``, ...), for streaming; the caller must not change it.
        None when the request is unknown or already reported by :meth:`step`."""
        return self._sequences.get(request_id)

    def take_events(self, request_id: int) -> list:
        """The tool-call parser's events of the tokens request ``request_id`` generated since the
        last call: :class:`kvtier.toolcall.ContentDelta`, ``ReasoningDelta``, ``ToolCall`` (each
        as soon as its ``<|tool_call_end|>`` is seen) and ``ToolCallProblem``, in output order.

        The request's one parser is fed here (a streaming consumer calls this after each step)
        and at the end by :meth:`step`, whose ``RequestOutput.events`` holds the events not taken
        yet, ending with the parser's ``finish``; how the output is cut into calls never changes
        ``content``, ``tool_calls`` and the other parsed fields. Empty when the request is
        unknown, already reported, or the engine has no tokenizer.
        """
        seq = self._sequences.get(request_id)
        return self._parse(seq) if seq is not None else []

    def _parse(self, seq: Sequence, final: bool = False) -> list:
        """Feed ``seq``'s output tokens not yet parsed to its parser (then end it when ``final``);
        returns the new events ([] without a parser)."""
        if seq.parser is None:
            return []
        new = seq.output_token_ids[seq.num_parsed_tokens:]
        seq.num_parsed_tokens += len(new)
        events = seq.parser.feed_ids(new)
        return events + seq.parser.finish() if final else events

    def abort(self, request_ids) -> None:
        """Drop unfinished requests (their pages are freed; nothing is returned for them)."""
        request_ids = set(request_ids)
        self._failed = [s for s in self._failed if s.seq_id not in request_ids]
        for rid in request_ids:
            seq = self._sequences.pop(rid, None)
            if seq is not None:
                self.scheduler.abort(seq)

    def _start_masks(self, batch):
        """Start filling the allowed-token rows of the constrained sequences that sample this step;
        returns a future of ``{seq_id: [1, ceil(vocab / 32)] int32 row or error message}``, or None."""
        seqs = [s for s, n in batch.extends if s.constraint is not None and s.num_computed_tokens + n == s.num_tokens]
        seqs += [s for s in batch.decodes if s.constraint is not None]
        if not seqs:
            return None
        return self._mask_thread.submit(self._fill_masks, seqs)

    def _fill_masks(self, seqs: list[Sequence]) -> dict:
        from kvtier.toolcall import fill_bitmasks

        words = (self.model_config.vocab_size + 31) // 32
        bitmask = torch.zeros((len(seqs), words), dtype=torch.int32, pin_memory=self.runner.device.type == "cuda")
        t0 = time.perf_counter()
        try:
            errors = fill_bitmasks([s.constraint for s in seqs], bitmask.numpy(), self._mask_executor)
        except Exception as e:  # noqa: BLE001 - reported on these requests, the engine keeps serving
            errors = [f"{type(e).__name__}: {e}"] * len(seqs)
        self.grammar_stats.add(masks=len(seqs), mask_s=time.perf_counter() - t0)
        for s, err in zip(seqs, errors):
            if err is not None and s.params.tool_grammar is not None:
                self.grammar_compiler().forget(s.params.tool_grammar)  # its copies may share the failure
        return {s.seq_id: (err if err is not None else bitmask[i:i + 1]) for i, (s, err) in enumerate(zip(seqs, errors))}

    def _prompt_logprobs(self, seq: Sequence, res) -> None:
        if res is not None and res.prompt_logits is not None:
            targets = torch.tensor([seq.prompt_token_ids[p + 1] for p in res.prompt_positions])
            lp = torch.log_softmax(res.prompt_logits, -1).gather(1, targets[:, None].to(res.prompt_logits.device))
            # Positions it reports as cached stay None, also when a preemption made it recompute
            # them (``num_cached_tokens`` is its first admission's; RequestOutput's contract).
            for p, v in zip(res.prompt_positions, lp.squeeze(1).tolist()):
                if p >= seq.num_cached_tokens:
                    seq.prompt_logprobs[p] = v

    def _sample(self, rows: list[tuple[Sequence, torch.Tensor, object]]) -> dict[int, int | Exception]:
        """The step's tokens of the sequences that sample, in one :func:`kvtier.ops.sample` call.

        Args:
            rows: ``(seq, next_token_logits, token_bitmask)`` per sequence, logits [vocab] fp32;
                ``token_bitmask`` is the ``[1, ceil(vocab / 32)]`` int32 allowed tokens of a
                constrained sequence, the message of the error that left it without one, or None.

        Each row samples under its own temperature / top-p, its grammar mask (rows without one
        allow every token) and its own generator (its seed's, else the engine's): one uniform
        per sampled row, so a seeded request gets the same tokens whatever it is batched with.
        Then each constraint takes its token (it may replace one that leaves no room to finish
        the turn) and the logprobs asked for are read in one pass.

        Returns:
            by ``seq_id``: the token, or the exception that failed that request (a grammar error
            fails its request only; a failing sampling call fails every request in it).
        """
        out: dict[int, int | Exception] = {}
        live = []
        for seq, logits, mask in rows:
            if isinstance(mask, str):
                from kvtier.toolcall import GrammarError

                out[seq.seq_id] = GrammarError(mask)
            else:
                live.append((seq, logits, mask))
        if not live:
            return out
        try:
            logits = torch.stack([row for _, row, _ in live])  # [rows, vocab]: one copy, for both uses
            sampled = self._sample_rows(live, logits)
        except Exception as e:  # noqa: BLE001 - the step's other requests keep going
            return out | {seq.seq_id: e for seq, _, _ in live}
        want_logprobs = []
        for i, (seq, _, _) in enumerate(live):
            try:
                if seq.constraint is not None:
                    sampled[i] = seq.constraint.take(sampled[i])
            except Exception as e:  # noqa: BLE001 - this request only
                out[seq.seq_id] = e
                continue
            out[seq.seq_id] = sampled[i]
            if seq.params.logprobs:
                want_logprobs.append(i)
        if want_logprobs:
            try:
                rows = logits[torch.tensor(want_logprobs, device=logits.device)]
                picked = torch.tensor([sampled[i] for i in want_logprobs], device=logits.device)
                lsm = torch.log_softmax(rows, -1)
                values = lsm.gather(1, picked[:, None]).squeeze(1).tolist()
                k = max(live[i][0].params.top_logprobs for i in want_logprobs)
                top = torch.topk(lsm, k, dim=-1) if k else None
                top_ids, top_vals = (top.indices.tolist(), top.values.tolist()) if k else ([], [])
            except Exception as e:  # noqa: BLE001 - fails the requests that asked for logprobs
                return out | {live[i][0].seq_id: e for i in want_logprobs}
            for j, (i, v) in enumerate(zip(want_logprobs, values)):
                seq = live[i][0]
                seq.logprobs.append(float(v))
                if seq.params.top_logprobs:
                    n = seq.params.top_logprobs
                    seq.top_logprobs.append(list(zip(top_ids[j][:n], top_vals[j][:n])))
        return out

    def _sample_rows(self, live, logits: torch.Tensor) -> list[int]:
        """One ``ops.sample`` over the rows of :meth:`_sample` (no error messages among them);
        ``logits``: their rows stacked, [len(live), vocab] fp32."""
        dev = logits.device
        params = [seq.params for seq, _, _ in live]
        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        masked = [i for i, (_, _, mask) in enumerate(live) if mask is not None]
        token_bitmask = None
        if masked:  # rows without a grammar allow every token (all 32 bits of each word set)
            token_bitmask = torch.full((len(live), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32, device=dev)
            token_bitmask[torch.tensor(masked, device=dev)] = torch.cat(
                [live[i][2] for i in masked]).to(dev, non_blocking=True)
        generators = [seq.generator or self.generator for seq, _, _ in live]
        # sampling-parameter plumbing: presence / frequency penalties (a copy; logprobs read the model's)
        logits = apply_penalties(logits, [(seq.output_token_ids, seq.params.presence_penalty,
                                           seq.params.frequency_penalty) for seq, _, _ in live])
        tokens = ops.sample(logits, temperature.to(dev), top_p.to(dev), token_bitmask=token_bitmask,
                            generator=generators, backend=self._sample_backend())
        return tokens.tolist()

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append ``token`` to ``seq``'s output; True (and ``seq`` finished) when it stops."""
        params = seq.params
        seq.output_token_ids.append(token)
        now = self.clock()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        reason = None
        if (seq.constraint is not None and seq.constraint.finished) or (
                token in self.model_config.eos_token_id and not params.ignore_eos):
            reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.model_config.max_position_embeddings:
            reason = "length"
        if reason is None:
            return False
        seq.metrics.finish_time = now
        self.scheduler.finish(seq, reason)
        return True

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.metrics.finish_step is None:
            seq.metrics.finish_step = self.num_steps
        parsed = {}
        if seq.parser is not None:  # the tokens take_events has not parsed yet, then the end
            events = self._parse(seq, final=True)
            parsed = {**seq.parser.result(), "events": events}
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs else None,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
            cached_tokens_by_tier=dict(seq.cached_tokens_by_tier),
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            last_prompt_block=_last_prompt_block(seq, self.pool.page_size),
            **parsed,
        )


def _last_prompt_block(seq: Sequence, page_size: int) -> bytes | None:
    full = seq.num_prompt_tokens // page_size
    return seq.block_hashes[full - 1] if 0 < full <= len(seq.block_hashes) else None


def _checked_int_array(ids, vocab: int) -> list[int] | None:
    """``ids`` as a list when it is a 1-D integer numpy array with every id in [0, vocab), else None."""
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        return None
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return None
    return ids.tolist()


def _is_bool(t) -> bool:
    """A Python, numpy or torch boolean (never a token id, though ``operator.index`` takes some)."""
    return isinstance(t, (bool, np.bool_)) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool)


def _as_int(t):
    """Python int for any integer-like token id (numpy/torch scalars too); other values unchanged."""
    if _is_bool(t):
        return t
    try:
        return operator.index(t)
    except TypeError:
        return t


def request_salt(cache_salt: str) -> bytes:
    """The bytes a request's ``cache_salt`` adds after the engine's block-hash salt (empty for
    ""; tagged, so that no request salt equals a suffix of an engine's ``cache_salt``)."""
    return b"\0request-salt:" + cache_salt.encode() if cache_salt else b""
