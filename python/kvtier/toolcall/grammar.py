"""Grammars of a Kimi K2 assistant turn with tools, compiled with llguidance.

One grammar covers the whole turn, in K2's token format (docs/kimi.md, "Chat template")::

    start:   TEXT? section?          (tool_choice "auto"; TEXT is any text without special tokens)
    section: <|tool_calls_section_begin|> call+ <|tool_calls_section_end|>
    call:    <|tool_call_begin|> ("functions.NAME:" IDX <|tool_call_argument_begin|> %json{parameters})
             <|tool_call_end|>

``"none"`` allows content only; ``"required"`` and a named function allow calls only (one call
when ``parallel_tool_calls`` is False). The turn ends with an end-of-turn token
(``<|im_end|>`` or the model's EOS), which llguidance allows once the grammar is complete.
Arguments are compact JSON matching each tool's schema (llguidance's JSON-schema compiler).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, fields

from kvtier.toolcall.grammar_errors import GrammarError, GrammarLimitError
from kvtier.toolcall.pattern_size import check_pattern_sizes
from kvtier.toolcall.tools import ToolSpec

IM_END = "<|im_end|>"
CALL_INDEX = "/0|[1-9][0-9]{0,5}/"  # K2 numbers calls across the conversation: functions.NAME:IDX


# llguidance.LLParserLimits fields a GrammarLimits passes through (None: llguidance's default).
_PARSER_FIELDS = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items",
                  "max_lexer_states", "max_grammar_size")


@dataclass(frozen=True)
class GrammarLimits:
    """Cost limits of one request's tool grammar.

    The parser and lexer limits are llguidance's own (``llguidance.LLParserLimits``; None keeps
    llguidance's default, given in brackets): they bound compilation and the work of every
    llguidance call, and a grammar that exceeds one fails (at compile time: a 400; while
    decoding: the request ends with an error).

    Attributes:
        max_items_in_row: Earley items in one row [2000].
        initial_lexer_fuel: fuel to build the lexer's regexes at compile time, ~50k/ms [1,000,000].
        step_lexer_fuel: lexer fuel of one mask computation, ~14k/ms [200,000].
        step_max_items: Earley items of one mask computation, ~20k/ms [50,000].
        max_lexer_states: lexer states (1-2 kB each) [250,000].
        max_grammar_size: symbols in the grammar's productions [500,000].
        compile_timeout_s: seconds one compile may take; longer is a :class:`GrammarLimitError`.
            Compiles run on their own threads, never on the engine's.
        mask_deadline_s: seconds one request may spend on one token's grammar work (the mask and
            its closing plan; the plan before the model runs and the check after sampling each
            have this long); a request that misses it ends with ``finish_reason`` ``"error"``.
        closing_fuel: matcher calls one search for a short completion of the turn may make
            (:func:`kvtier.toolcall.closing_tokens`; a bitmask counts 16); a search that runs
            out finds none, and the turn is then decoded under its mask alone (it may be cut
            by ``max_tokens``). Deterministic, unlike the deadline. The validity sweeps
            (tests/toolcall/test_sweep.py) need at most about 6,000; one call is 1-20 us.
        locate_compiles: trial compiles spent finding the schema keyword of a grammar that does
            not compile (within ``compile_timeout_s`` in all).
        max_pattern_size: positions a ``pattern`` keyword may have with its counted repetitions
            unrolled (:func:`kvtier.toolcall.pattern_size.pattern_size`), checked before compiling;
            more is a :class:`GrammarLimitError` naming the keyword. One llguidance call walks a
            pattern's positions holding the GIL (``^(a{1000}){1000}$`` stalled every request for
            about 90 s); at 10,000 a forced pattern costs at most about 0.07 s per token.

    Raises:
        ValueError: a limit that is not a positive number.
    """

    max_items_in_row: int | None = None
    initial_lexer_fuel: int | None = None
    step_lexer_fuel: int | None = None
    step_max_items: int | None = None
    max_lexer_states: int | None = None
    max_grammar_size: int | None = None
    compile_timeout_s: float = 10.0
    mask_deadline_s: float = 2.0
    closing_fuel: int = 32_768
    locate_compiles: int = 48
    max_pattern_size: int = 10_000

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in _PARSER_FIELDS:
                continue
            integer = f.name in _PARSER_FIELDS or f.name in ("closing_fuel", "locate_compiles", "max_pattern_size")
            ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and v == v
            if not ok or isinstance(v, bool) or v <= 0:
                kind = "an int" if integer else "a number"
                raise ValueError(f"GrammarLimits.{f.name} must be {kind} > 0, got {v!r}")

    @classmethod
    def from_dict(cls, values: dict) -> GrammarLimits:
        """Limits from ``{"field": value}`` (e.g. ``--grammar-limits`` JSON).

        Raises:
            ValueError: not a dict, an unknown field (naming the known ones) or a bad value.
        """
        if not isinstance(values, dict):
            raise ValueError(f"grammar limits must be a JSON object, got {type(values).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"grammar limits: unknown field(s) {unknown}; expected some of {known}")
        return cls(**values)

    def parser_limits(self):
        """These limits as an ``llguidance.LLParserLimits`` (short error messages: no parser state)."""
        import llguidance

        given = {k: v for k, v in asdict(self).items() if k in _PARSER_FIELDS and v is not None}
        return llguidance.LLParserLimits(verbose_errors=False, **given)


class GrammarStats:
    """Counters of grammar work, shared by the threads that compile and fill masks (thread-safe).

    Attributes (read with :meth:`snapshot`):
        compiles: grammars compiled; compile_errors: compiles that failed (a limit or an error);
        compile_s: seconds spent compiling; cache_hits: grammars served from the compile cache;
        masks: mask rows computed; mask_s: seconds spent on them (plans included);
        out_of_fuel: closing searches that ran out of ``closing_fuel``;
        cut: requests ended by a limit, by kind (``compile``: refused, ``deadline``: a token's
        grammar work missed ``mask_deadline_s``, ``parser``: an llguidance limit while decoding).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.compiles = self.compile_errors = self.cache_hits = self.masks = self.out_of_fuel = 0
        self.compile_s = self.mask_s = 0.0
        self.cut: dict[str, int] = {"compile": 0, "deadline": 0, "parser": 0}

    def add(self, **amounts) -> None:
        """Add ``amounts`` to the named counters (``cut_<kind>=1`` adds to ``cut[kind]``)."""
        with self._lock:
            for k, v in amounts.items():
                if k.startswith("cut_"):
                    self.cut[k[4:]] = self.cut.get(k[4:], 0) + v
                else:
                    setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict:
        with self._lock:
            return {"compiles": self.compiles, "compile_errors": self.compile_errors, "compile_s": self.compile_s,
                    "cache_hits": self.cache_hits, "masks": self.masks, "mask_s": self.mask_s,
                    "out_of_fuel": self.out_of_fuel, "cut": dict(self.cut)}


def turn_grammar(
    specs: Sequence[ToolSpec], choice: str, parallel_tool_calls: bool = True,
    response_schema: dict | None = None,
) -> str:
    """The Lark (llguidance dialect) grammar of an assistant turn.

    Args:
        specs: the declared tools (from :func:`kvtier.toolcall.tools.normalize_tools`).
        choice: ``"auto"``, ``"none"``, ``"required"`` or a tool name
            (:func:`kvtier.toolcall.tools.normalize_tool_choice`).
        parallel_tool_calls: allow more than one call in the section.
        response_schema: the JSON schema the content must be an instance of (``response_format``),
            or None for any text; with ``"auto"`` the turn is an instance with optional calls, or
            calls alone; with calls required there is no content to constrain.

    Returns:
        the grammar text for ``llguidance.grammar_from("lark", ...)``.
    """
    lines = ["%llguidance {}", "TEXT: /(?s:.+)/"]
    if response_schema is not None:
        lines.append(f"answer: %json {json.dumps(response_schema, ensure_ascii=False)}")
    if choice == "none" or not specs:
        return "\n".join([*lines, "start: TEXT?" if response_schema is None else "start: answer"])
    names = [s for s in specs if choice in ("auto", "required") or s.name == choice]
    repeat = "+" if parallel_tool_calls else ""
    if choice != "auto":
        start = "start: section"
    else:  # with a response format: the JSON answer (calls optional), or calls alone
        start = "start: TEXT? section?" if response_schema is None else "start: answer section? | section"
    lines += [
        start,
        f"section: <|tool_calls_section_begin|> call{repeat} <|tool_calls_section_end|>",
        "call: <|tool_call_begin|> ("
        + " | ".join(f"fn_{i}" for i in range(len(names)))
        + ") <|tool_call_end|>",
    ]
    for i, s in enumerate(names):
        lines.append(
            f"fn_{i}: {json.dumps(f'functions.{s.name}:')} {CALL_INDEX} <|tool_call_argument_begin|> args_{i}"
        )
        try:
            schema = json.dumps(s.grammar_schema(), ensure_ascii=False)
        except RecursionError:
            raise ValueError(
                f"tools[{specs.index(s)}].function.parameters: nested too deeply to process"
            ) from None
        lines.append(f"args_{i}: %json {schema}")
    return "\n".join(lines)


class GrammarCompiler:
    """Compiles turn grammars for one tokenizer under :class:`GrammarLimits` and keeps the
    compiled ones (LRU). Thread-safe: the server compiles on its request threads, never on the
    engine thread.

    Args:
        tokenizer: the :class:`~kvtier.tokenize.KimiTokenizer` whose ids the model samples.
        end_of_turn_ids: ids that end a turn (``<|im_end|>`` plus the model's EOS ids).
        cache_size: compiled grammars kept; a hit costs one matcher copy instead of a compile.
        limits: the cost limits (default :class:`GrammarLimits`).
        stats: counters to update (default: a new :class:`GrammarStats`).

    Building the llguidance tokenizer takes about a second (it indexes all 163,840 tokens).
    """

    def __init__(self, tokenizer, end_of_turn_ids: Sequence[int], cache_size: int = 64,
                 limits: GrammarLimits | None = None, stats: GrammarStats | None = None):
        import llguidance
        from llguidance.tiktoken import lltokenizer_from_encoding

        self._llg = llguidance
        self.tokenizer = tokenizer
        self.limits = limits if limits is not None else GrammarLimits()
        self.stats = stats if stats is not None else GrammarStats()
        self._parser_limits = self.limits.parser_limits()
        self.end_of_turn_ids = tuple(dict.fromkeys(end_of_turn_ids))
        self.ll_tokenizer = lltokenizer_from_encoding(
            tokenizer._enc,
            n_vocab=tokenizer.n_vocab,
            eos_token=list(self.end_of_turn_ids),
        )
        self.vocab_size = tokenizer.n_vocab
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # llguidance drops the GIL while it compiles; a compile past its timeout is left to end
        # here (its own fuel limits bound it) while the caller gets the error.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-grammar")

    def _build(self, lark: str):
        return self._llg.LLMatcher(self.ll_tokenizer, self._llg.grammar_from("lark", lark), log_level=0,
                                   limits=self._parser_limits)

    def _timed(self, lark: str, timeout_s: float):
        """(matcher, None), or (None, reason) when it does not compile within ``timeout_s``."""
        t0 = time.perf_counter()
        try:
            matcher = self._pool.submit(self._build, lark).result(timeout=timeout_s)
        except FutureTimeout:
            return None, f"compiling took longer than compile_timeout_s={self.limits.compile_timeout_s:g} s"
        finally:
            self.stats.add(compiles=1, compile_s=time.perf_counter() - t0)
        if matcher.is_error():
            return None, _reason(matcher.get_error())
        return matcher, None

    def compile(self, lark: str, specs: Sequence[ToolSpec] | None = None):
        """Compile ``lark`` into a new ``llguidance.LLMatcher`` (no cache).

        Args:
            lark: a grammar from :func:`turn_grammar`.
            specs: the tools it was built from; when given, a grammar that does not compile is
                traced to the tool and schema keyword at fault (:meth:`locate`).

        Raises:
            GrammarError: llguidance rejected the grammar or a limit was exceeded
                (:class:`GrammarLimitError` for the compile timeout, and for a ``pattern`` of
                ``specs`` over ``limits.max_pattern_size``, refused before compiling); the message
                starts with the keyword's path when ``specs`` locate it.
        """
        if specs:
            try:
                check_pattern_sizes(specs, self.limits.max_pattern_size)
            except GrammarLimitError:
                self.stats.add(compiles=1, compile_errors=1)
                raise
        matcher, reason = self._timed(lark, self.limits.compile_timeout_s)
        if matcher is not None:
            return matcher
        self.stats.add(compile_errors=1)
        path = self.locate(specs) if specs else None
        cls = GrammarLimitError if reason.startswith("compiling took longer") else GrammarError
        raise cls(f"{path + ': ' if path else ''}the tool grammar does not compile: {reason}", path)

    def matcher(self, lark: str, specs: Sequence[ToolSpec] | None = None):
        """A fresh ``llguidance.LLMatcher`` for grammar ``lark`` (compiled once, then copied).

        Raises:
            GrammarError: see :meth:`compile`.
        """
        with self._lock:
            pristine = self._cache.get(lark)
            if pristine is not None:
                self._cache.move_to_end(lark)
                self.stats.add(cache_hits=1)
                return pristine.deep_copy()
        pristine = self.compile(lark, specs)
        with self._lock:
            self._cache[lark] = pristine
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return pristine.deep_copy()

    def forget(self, lark: str) -> bool:
        """Drop grammar ``lark``'s compiled copy (True if it was kept). Copies share the lazily
        built lexer of the one they were made from: after a request's matcher failed while
        decoding (llguidance's "too many expressions constructed", say), the next copy would fail
        at once, so the next request compiles afresh."""
        with self._lock:
            return self._cache.pop(lark, None) is not None

    def locate(self, specs: Sequence[ToolSpec]) -> str | None:
        """The JSON path of the schema keyword that keeps the tools' grammar from compiling
        (``tools[0].function.parameters.properties.x.minimum``), ``tools[i].function.parameters``
        when no single keyword is to blame, or None when every tool compiles alone.

        Each tool's arguments grammar is compiled alone; in the first that fails, the search
        descends into the subschema whose replacement by ``{}`` makes it compile, then drops
        that subschema's keywords one at a time. At most ``limits.locate_compiles`` trial
        compiles within ``limits.compile_timeout_s`` seconds in all; when that runs out, the
        deepest path found so far.
        """
        deadline = time.monotonic() + self.limits.compile_timeout_s
        trials = [self.limits.locate_compiles]

        def fails(schema) -> bool:
            left = deadline - time.monotonic()
            if trials[0] <= 0 or left <= 0:
                raise _Exhausted
            trials[0] -= 1
            lark = "%llguidance {}\nstart: %json " + json.dumps(schema, ensure_ascii=False)
            return self._timed(lark, left)[0] is None

        for i, spec in enumerate(specs):
            root = spec.grammar_schema()
            best: list = [[]]
            try:
                if not fails(root):
                    continue
            except _Exhausted:  # no time left to tell which tool it is
                return None
            try:
                _descend(root, [], fails, best)
            except (_Exhausted, RecursionError):  # out of trials, or nesting Python cannot walk
                pass
            return f"tools[{i}].function.parameters" + _fmt(best[0])
        return None


class _Exhausted(Exception):
    pass


# Keywords that only constrain values: dropping one never breaks the rest of the schema.
_VALUE_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum", "enum",
                   "format", "required", "additionalProperties", "items", "anyOf", "$ref", "type")


def _children(s: dict):
    """(path parts, subschema) of ``s``'s direct subschemas, in the validator's walk order
    (``$defs`` entries are reached through the ``$ref`` that uses them)."""
    if isinstance(s.get("properties"), dict):
        for name, sub in s["properties"].items():
            if isinstance(sub, dict):
                yield ("properties", name), sub
    for key in ("items", "additionalProperties"):
        if isinstance(s.get(key), dict):
            yield (key,), s[key]
    for i, b in enumerate(s.get("anyOf") or [] if isinstance(s.get("anyOf"), list) else []):
        if isinstance(b, dict):
            yield (("anyOf", i),), b


def _fmt(parts) -> str:
    out = ""
    for p in parts:
        out += f".{p[0]}[{p[1]}]" if isinstance(p, tuple) else f".{p}"
    return out


_NEUTRAL = {"type": "null"}  # a cheap stand-in for a subschema (it keeps an anyOf a union)


def _at(root: dict, parts: list) -> dict:
    node = root
    for p in parts:
        node = node[p[0]][p[1]] if isinstance(p, tuple) else node[p]
    return node


def _edited(root: dict, neutral=(), drop: list | None = None) -> dict:
    """A deep copy of ``root`` with the subschemas at each path of ``neutral`` replaced by
    ``{"type": "null"}`` and the keyword at path ``drop`` removed."""
    out = copy.deepcopy(root)
    for parts in neutral:
        parent, last = _at(out, parts[:-1]), parts[-1]
        if isinstance(last, tuple):
            parent[last[0]][last[1]] = dict(_NEUTRAL)
        else:
            parent[last] = dict(_NEUTRAL)
    if drop is not None:
        del _at(out, drop[:-1])[drop[-1]]
    return out


def _descend(root: dict, parts: list, fails, best: list, seen: frozenset = frozenset()) -> None:
    """Narrow ``best[0]`` (path parts) from the failing subschema at ``parts`` to the keyword at
    fault. If neutralising all its subschemas makes the schema compile, the fault is below: a
    bisection finds one subschema that fails with its siblings neutralised (then descend into
    it), or else it is their number (the containing keyword: ``anyOf``, ``properties``, ...).
    Otherwise it is one of the node's own keywords: the first whose removal compiles."""
    node = _at(root, parts)
    kids = [parts + list(sub) for sub, _ in _children(node)]
    if kids and not fails(_edited(root, kids)):
        def alone(keep):
            return fails(_edited(root, [k for k in kids if k not in keep]))

        group = kids
        while len(group) > 1:
            half = len(group) // 2
            if alone(group[:half]):
                group = group[:half]
            elif alone(group[half:]):
                group = group[half:]
            else:
                group = []
        if group and (len(kids) == 1 or alone(group)):
            best[0] = group[0]
            _descend(root, group[0], fails, best, seen)
            return
        for key in ("anyOf", "properties"):
            inside = [k for k in kids if (k[len(parts)][0] if isinstance(k[len(parts)], tuple) else k[len(parts)]) == key]
            if inside and not fails(_edited(root, inside)):
                best[0] = parts + [key]
                return
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/") and ref not in seen and not kids:
        target = ["$defs", ref[len("#/$defs/"):]]
        if isinstance(root.get("$defs"), dict) and isinstance(root["$defs"].get(target[1]), dict):
            best[0] = target
            _descend(root, target, fails, best, seen | {ref})
            return
    for key in _VALUE_KEYWORDS:
        if key in node and not fails(_edited(root, drop=parts + [key])):
            best[0] = parts + [key]
            return


def _reason(error: str) -> str:
    """llguidance's error on one line: the grammar excerpt, caret marks and location prefix dropped."""
    import re

    lines = [ln.strip() for ln in error.splitlines()]
    kept = [ln for ln in lines if ln and not re.match(r"^\d+ \|", ln) and set(ln) - set("^ ")]
    text = " ".join(kept)
    return re.sub(r"^at \d+\(\d+\): ", "", text)[:600]
