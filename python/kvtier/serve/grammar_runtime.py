"""Tool-call grammars at run time: compile a request's grammar, give it a constraint, fill the
allowed-token masks of the constrained sequences of a step (on a thread of its own, while the
model runs) and count the grammars that ended a request (vLLM's ``StructuredOutputManager``
role)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.serve.params import SamplingParams
from kvtier.serve.request import Sequence
from kvtier.serve.step_plan import ScheduledBatch


class GrammarRuntime:
    """The grammar compiler of one engine and the masks of its steps.

    Args:
        model_config: the model's config (``vocab_size``, ``eos_token_id``).
        device: where the model runs (masks are pinned for a CUDA device).

    Attributes:
        tokenizer: the engine's tokenizer (None: requests with tools are refused).
        limits: a :class:`kvtier.toolcall.GrammarLimits` (None: its defaults); set it before the
            first request with tools.
        stats: a :class:`kvtier.toolcall.GrammarStats`, built with the compiler.
    """

    def __init__(self, model_config, device: torch.device):
        self.model_config, self.device = model_config, device
        self.tokenizer = None
        self.limits = None
        self.stats = None
        self._compiler = None  # kvtier.toolcall.GrammarCompiler, built on the first request with tools
        self._lock = threading.Lock()
        self._token_table = None
        self._mask_thread: ThreadPoolExecutor | None = None
        self._mask_executor = None  # llguidance.LLExecutor
        self._k3_grammars: dict[str, str] = {}  # K2 grammar -> the K3 grammar of the same request fields

    def compiler(self):
        """The :class:`kvtier.toolcall.GrammarCompiler` of :attr:`tokenizer` under :attr:`limits`
        (built on first use, about a second; thread-safe).

        Raises:
            ValueError: no tokenizer.
        """
        with self._lock:
            if self._compiler is None:
                import llguidance

                from kvtier.toolcall import GrammarCompiler, GrammarLimits, GrammarStats, TokenTable

                if self.tokenizer is None:
                    raise ValueError("tools need a tokenizer: call Engine.attach_tokenizer(tokenizer) first")
                end = "<|end_of_msg|>" if self._k3() else "<|im_end|>"
                eot = [self.tokenizer.token_id(end), *self.model_config.eos_token_id]
                self.limits = self.limits or GrammarLimits()
                self.stats = GrammarStats()
                compiler = GrammarCompiler(self.tokenizer, eot, limits=self.limits, stats=self.stats)
                self._token_table = TokenTable(self.tokenizer, compiler.end_of_turn_ids)
                self._mask_executor = llguidance.LLExecutor()
                self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-masks")
                self._compiler = compiler
            return self._compiler

    def _k3(self) -> bool:
        from kvtier.tokenize.formats import ChatFormat

        return getattr(self.tokenizer, "chat_format", None) is ChatFormat.K3_XTML

    def grammar(self, params: SamplingParams) -> str:
        """The turn grammar of ``params`` in the tokenizer's chat format: ``params.tool_grammar``
        (K2's) or the K3 grammar of the same tools, choice and response format
        (:func:`kvtier.toolcall.xtml_grammar.xtml_turn_grammar`, kept per K2 grammar)."""
        if not self._k3():
            return params.tool_grammar
        with self._lock:
            lark = self._k3_grammars.get(params.tool_grammar)
        if lark is None:
            from kvtier.toolcall.xtml_grammar import xtml_turn_grammar

            lark = xtml_turn_grammar(params.tool_specs, params.tool_choice_name, params.parallel_tool_calls,
                                     params.response_schema)
            with self._lock:
                self._k3_grammars[params.tool_grammar] = lark
                while len(self._k3_grammars) > 256:
                    self._k3_grammars.pop(next(iter(self._k3_grammars)))
        return lark

    def compile(self, params: SamplingParams):
        """A fresh ``llguidance.LLMatcher`` of ``params``' turn grammar (:meth:`grammar`;
        thread-safe; cached by grammar).

        Raises:
            GrammarError: the grammar does not compile or exceeds a limit.
        """
        try:
            return self.compiler().matcher(self.grammar(params), params.tool_specs)
        except ValueError:
            self.stats.add(cut_compile=1)
            raise

    def attach(self, seq: Sequence, matcher=None) -> None:
        """Give new ``seq`` its output parser (with a tokenizer; K3's :class:`kvtier.toolcall.xtml_parser.XtmlParser`
        starting in the channel its prompt opened, or K2's ``ToolCallParser``) and, with a tool
        grammar, its constraint over ``matcher`` (None: compiled here; K3's is primed with the
        prompt's channel tag).

        Raises:
            ValueError: the grammar does not compile (the parser is attached already).
        """
        prompt = seq.prompt_token_ids if seq.prompt_token_ids is not None else ()
        if self.tokenizer is not None and self._k3():
            from kvtier.toolcall.xtml_parser import XtmlParser

            seq.parser = XtmlParser.for_tokenizer(self.tokenizer, prompt)
        elif self.tokenizer is not None:
            from kvtier.toolcall import ToolCallParser

            seq.parser = ToolCallParser.for_tokenizer(self.tokenizer)
        if seq.params.tool_grammar is not None:
            seq.constraint = self.constraint(seq.params, matcher)
            if self._k3():  # the turn grammar starts at the channel the generation prompt opened
                from kvtier.toolcall.xtml_parser import channel_opening

                seq.constraint.prime(channel_opening(prompt, self.tokenizer))

    def constraint(self, params: SamplingParams, matcher=None):
        """A fresh constraint for ``params.tool_grammar`` over ``matcher`` (None: compiled here)."""
        from kvtier.toolcall import ToolCallConstraint

        if matcher is None:
            matcher = self.compile(params)
        return ToolCallConstraint(matcher, self._token_table, params.max_tokens, self.limits, self.stats)

    def start_masks(self, batch: ScheduledBatch) -> Future | None:
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
        bitmask = torch.zeros((len(seqs), words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        t0 = time.perf_counter()
        try:
            errors = fill_bitmasks([s.constraint for s in seqs], bitmask.numpy(), self._mask_executor)
        except Exception as e:  # noqa: BLE001 - reported on these requests, the engine keeps serving
            errors = [f"{type(e).__name__}: {e}"] * len(seqs)
        self.stats.add(masks=len(seqs), mask_s=time.perf_counter() - t0)
        for s, err in zip(seqs, errors):
            if err is not None and s.params.tool_grammar is not None:
                self.compiler().forget(self.grammar(s.params))  # its copies may share the failure
        return {s.seq_id: (err if err is not None else bitmask[i:i + 1]) for i, (s, err) in enumerate(zip(seqs, errors))}

    def count_cut(self, seq: Sequence, e: Exception) -> None:
        """Count a constrained request its grammar ended: a missed deadline, or an llguidance
        limit while decoding (the only way a masked matcher fails)."""
        if seq.constraint is None or self.stats is None:
            return
        from kvtier.toolcall import GrammarError

        if isinstance(e, GrammarError):
            deadline = "GrammarLimitError" in str(e) or type(e).__name__ == "GrammarLimitError"
            self.stats.add(**{"cut_deadline" if deadline else "cut_parser": 1})


__all__ = ["GrammarRuntime"]
