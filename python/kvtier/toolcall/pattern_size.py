"""A static bound on the ``pattern`` keywords of tool schemas, checked before a grammar is compiled.

llguidance compiles a turn grammar lazily: building the matcher takes milliseconds whatever the
patterns, and the lexer states of a pattern are built by the first calls that walk it (forced
tokens, masks, the closing search of :mod:`kvtier.toolcall.closing`). One such call runs in
llguidance without releasing the GIL, and its cost grows with the number of positions the
pattern has once counted repetitions are written out: ``^x{20000}$`` costs about 0.5 s per
token, ``^(a{1000}){1000}$`` (a million positions, every one forced) held the GIL for about
90 s on its first token and stalled every other request, ``/health`` included. The deadline of
:class:`~kvtier.toolcall.grammar.GrammarLimits` is checked between llguidance calls, so it cannot
cut one short; the size is therefore bounded here, before anything is compiled.

The size is that of the pattern with every counted repetition unrolled (the measure of a
Thompson NFA, and of the Rust ``regex`` crate's size limit): a literal, a character class, an
escape or ``.`` is 1; a sequence and an alternation are the sums of their parts; ``X{n}``,
``X{m,n}``, ``X{,n}`` are ``n`` times ``X`` and ``X{n,}`` is ``max(n, 1)`` times ``X``; ``*``, ``+``, ``?``
count ``X`` once. Anchors and flag groups are 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvtier.toolcall.grammar_errors import GrammarLimitError
from kvtier.toolcall.tools import ToolSpec

_COUNT = re.compile(r"\{(\d*)(,(\d*))?\}[?+]?")  # {n}, {m,n}, {n,}, {,n}
_GROUP_PREFIX = re.compile(r"\?(?:P?<[^>]*>|[a-zA-Z-]*:|[a-zA-Z-]*(?=\)))")


def pattern_size(pattern: str) -> int:
    """The number of positions of ``pattern`` with its counted repetitions unrolled (see the
    module docstring), in Rust ``regex`` syntax (llguidance's dialect).

    Args:
        pattern: a regular expression (already accepted by llguidance; on a malformed one the
            result is still a finite count).

    Returns:
        the size, an int >= 0 (Python ints: nested counts never overflow).

    Raises:
        TypeError: ``pattern`` is not a str.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
    # One frame per open group: [finished alternatives, current branch, size of its last item].
    stack = [[0, 0, 0]]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        frame = stack[-1]
        if c == "\\":
            i = _escape_end(pattern, i)
            frame[1] += 1
            frame[2] = 1
            continue
        if c == "[":
            i = _class_end(pattern, i)
            frame[1] += 1
            frame[2] = 1
            continue
        if c == "(":
            prefix = _GROUP_PREFIX.match(pattern, i + 1)
            i = prefix.end() if prefix else i + 1
            stack.append([0, 0, 0])
            continue
        if c == ")" and len(stack) > 1:
            done = stack.pop()
            size = done[0] + done[1]
            stack[-1][1] += size
            stack[-1][2] = size
            i += 1
            continue
        if c == "|":
            frame[0] += frame[1]
            frame[1] = frame[2] = 0
            i += 1
            continue
        count = _COUNT.match(pattern, i) if c == "{" else None
        if count is not None and not (count.group(1) or count.group(3)):
            count = None  # "{}" or "{,}": a literal brace
        if count is not None or c in "*+?":
            times = 1 if count is None else _times(count)
            frame[1] += frame[2] * (times - 1)
            frame[2] *= times
            i = count.end() if count is not None else i + 1
            if count is None and i < n and pattern[i] in "?+":  # lazy or possessive
                i += 1
            continue
        if c in "^$":
            frame[2] = 0
        else:
            frame[1] += 1
            frame[2] = 1
        i += 1
    return sum(f[0] + f[1] for f in stack)


def _times(count: re.Match) -> int:
    low, comma, high = count.group(1), count.group(2), count.group(3)
    if comma is None:
        return int(low)
    return int(high) if high else max(int(low or 0), 1)


def _escape_end(pattern: str, i: int) -> int:
    """The index after the escape starting at ``pattern[i] == "\\\\"`` (``\\p{..}``, ``\\x{..}``,
    ``\\u{..}`` read to their closing brace)."""
    j = i + 2
    if j <= len(pattern) and pattern[i + 1:j] in ("p", "P", "x", "u", "U") and pattern[j:j + 1] == "{":
        close = pattern.find("}", j)
        return len(pattern) if close < 0 else close + 1
    return min(j, len(pattern))


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opened at ``pattern[i] == "["`` (nested classes,
    escapes and a leading ``]`` included)."""
    depth, j, n = 0, i, len(pattern)
    while j < n:
        c = pattern[j]
        if c == "\\":
            j = _escape_end(pattern, j)
            continue
        if c == "[":
            depth += 1
            j += 1
            if pattern.startswith("^", j):
                j += 1
            if pattern.startswith("]", j):  # a literal ] first in the class
                j += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return n


def _schemas(node: dict, path: str):
    """(path, schema) of ``node`` and every schema below it, through the keywords that hold
    schemas (``properties``, ``$defs``, ``items``, ``additionalProperties``, ``anyOf``); never
    into values such as ``enum`` or ``default``. Iterative: any nesting depth."""
    todo = [(path, node)]
    while todo:
        path, s = todo.pop()
        yield path, s
        for key in ("properties", "$defs"):
            if isinstance(s.get(key), dict):
                todo += [(f"{path}.{key}.{name}", sub) for name, sub in s[key].items() if isinstance(sub, dict)]
        for key in ("items", "additionalProperties"):
            if isinstance(s.get(key), dict):
                todo.append((f"{path}.{key}", s[key]))
        if isinstance(s.get("anyOf"), list):
            todo += [(f"{path}.anyOf[{j}]", sub) for j, sub in enumerate(s["anyOf"]) if isinstance(sub, dict)]


def check_pattern_sizes(specs: Sequence[ToolSpec], max_size: int) -> None:
    """Refuse the first ``pattern`` of the tools' parameters (in tool order) whose unrolled size
    (:func:`pattern_size`) exceeds ``max_size``; a static check of microseconds per pattern.

    Args:
        specs: the declared tools (:func:`kvtier.toolcall.tools.normalize_tools`).
        max_size: the limit (``GrammarLimits.max_pattern_size``).

    Raises:
        GrammarLimitError: whose ``path`` is the keyword's
            (``tools[0].function.parameters.properties.x.pattern``) and whose message starts
            with it, then gives the size and the limit.
    """
    for i, spec in enumerate(specs):
        for path, s in _schemas(spec.grammar_schema(), f"tools[{i}].function.parameters"):
            pattern = s.get("pattern")
            if not isinstance(pattern, str):
                continue
            size = pattern_size(pattern)
            if size > max_size:
                where = f"{path}.pattern"
                raise GrammarLimitError(
                    f"{where}: the tool grammar does not compile: the pattern has {size:,} positions with its "
                    f"counted repetitions unrolled, more than max_pattern_size={max_size:,} (each position costs "
                    "grammar work on every token); use smaller repeat counts, or minLength/maxLength", where)
