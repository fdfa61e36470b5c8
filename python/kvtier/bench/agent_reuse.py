"""The reuse report of ``kvtier bench --workload sdk-agents`` (sessions:
:mod:`kvtier.bench.agent_sessions`): per turn, the cached tokens the server reported divided by
the tokens it could have found, by API and by what the reused turn was.

Reachable tokens of turn k >= 1 of a session (the page bound): the previous turn's prompt and
output whose KV was computed, in whole pages::

    reachable_k = floor((prompt_{k-1} + output_{k-1} - 1) / page_size) * page_size

(the last sampled token is never run through the model, so its KV does not exist; the next
turn's prompt starts with all of turn k-1 when the client sends back what it got). The row's
``kind`` is what turn k-1 produced: ``tool`` (it made tool calls, and turn k carries their
results) or ``text``. A new session (turn 0 of every session but the run's first) can reach
the prefix its first prompt shares with the first prompt of a session sent before it (the same
system prompt and tools, and by chance the first tokens of the user message's tag), rendered in
the served model's chat format (K2's template or K3's XTML) and encoded, in whole pages
(``new-session``; :func:`new_session_bounds`; not counted without a tokenizer). The run's first
request reaches nothing (``first``, not counted).

The restated bound (``restated_tokens``) is where a turn can resume given the renderer's
boundaries (``boundaries()`` of the session encoders, :mod:`kvtier.tokenize.xtml_session`):

- a turn sampled after a format tail (K3's ``tool-choice`` system message: turn k-1 forced tool
  calls) was prompted with the tail between its history and its generation prompt; turn k's
  prompt has the sampled message there instead, so the KV of turn k-1's output (computed after
  the tail) can never be served to it. Its bound is the end of turn k-1's history (the end of the
  last message before the tail), in whole pages::

      restated_k = floor((prompt_{k-1} - after_history) / page_size) * page_size

  with ``after_history`` the ids a forced prompt holds after its history's end (the tail and the
  generation prompt), measured on the renderer (:func:`prompt_tail`). The tail and the next
  assistant message open with the same few tokens, so a turn can find a page more where a grid
  checkpoint (``--state-checkpoint-tokens``) falls among them (a restated ratio just above 1);
- a new session on a model that resumes only at state checkpoints (a hybrid KDA + MLA model):
  the last boundary the renderer names (the tool declaration's end, the first user message's
  opening tag) within the shared prefix, in whole pages;
- every other row: the page bound.

``reached_checkpoint``: the turn's cached tokens reach its restated bound (for a hybrid model,
the checkpoint there was found: the turn end, the history end before a tail, or the shared
prefix's last boundary).

``ratio = cached / reachable`` and ``restated_ratio = cached / restated`` per row; a group's
ratio is sum(cached) / sum(reachable) (and the same over the restated bounds), with the lowest
row ratio, the rows at >= 0.99, the rows at their checkpoint and the turns lost whole beside it:
rows of ``text`` and ``tool`` whose cached tokens stop at or before the previous prompt's last
whole page, so nothing turn k-1 generated came back (``lost_turns``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

KINDS = ("text", "tool", "new-session")
FULL = 0.99  # a row at or above this share of its bound counts as reusing it all


def reachable_tokens(prev_prompt: int, prev_output: int, page_size: int) -> int:
    """Tokens of the previous turn whose KV exists, in whole pages (module docstring).

    Raises:
        ValueError: ``page_size`` < 1 or a negative count.
    """
    if page_size < 1 or prev_prompt < 0 or prev_output < 0:
        raise ValueError(f"page_size must be >= 1 and token counts >= 0, got page_size={page_size}, "
                         f"prev_prompt={prev_prompt}, prev_output={prev_output}")
    return max(prev_prompt + prev_output - 1, 0) // page_size * page_size


def restated_tokens(prev_prompt: int, after_history: int, page_size: int) -> int:
    """The restated bound of a turn sampled after a format tail: the end of the previous prompt's
    history (``prev_prompt - after_history`` ids), in whole pages (module docstring).

    Args:
        prev_prompt: the previous turn's prompt, in tokens.
        after_history: the ids that prompt held after its history's end (the tail and the
            generation prompt; :func:`prompt_tail`).
        page_size: tokens per page.

    Raises:
        ValueError: ``page_size`` < 1, a negative count, or ``after_history`` > ``prev_prompt``.
    """
    if page_size < 1 or prev_prompt < 0 or not 0 <= after_history <= prev_prompt:
        raise ValueError(f"page_size must be >= 1 and 0 <= after_history <= prev_prompt, got page_size={page_size}, "
                         f"prev_prompt={prev_prompt}, after_history={after_history}")
    return (prev_prompt - after_history) // page_size * page_size


def _encoded_first_prompt(tokenizer, content: str, forced: bool = False):
    """A session encoder (:func:`kvtier.tokenize.xtml_session.session_encoder`) holding a first
    prompt (system prompt, tools, one user message ``content``) in ``tokenizer``'s chat format
    (K2's template, or K3's XTML with ``tool_choice`` ``required`` when ``forced``, else ``auto``)."""
    from kvtier.bench.agent_sessions import SYSTEM, ChatDriver
    from kvtier.tokenize import ChatFormat
    from kvtier.tokenize.xtml_session import session_encoder

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    tools = ChatDriver(None, "").tools
    enc = session_encoder(tokenizer)
    if getattr(tokenizer, "chat_format", ChatFormat.K2_TEMPLATE) is ChatFormat.K3_XTML:
        from kvtier.tokenize.xtml import XtmlOptions

        enc.append(messages, tools, XtmlOptions(tool_choice="required" if forced else "auto"))
    else:
        enc.append(messages, tools)
    return enc


def prompt_tail(tokenizer) -> tuple[int, int] | None:
    """``(tail, after_history)`` of a forced turn's prompt in ``tokenizer``'s chat format, from the
    renderer's ``boundaries()["history"]``: ``after_history`` the ids after the end of its last
    history message (the format's tail and the generation prompt), ``tail`` how many of them an
    unforced prompt does not hold (K3: the ``tool-choice`` message; 0 for K2's template, which
    renders no tail). Both hold for any history: each part of a prompt is encoded on its own.
    None without a tokenizer."""
    if tokenizer is None:
        return None
    after = {}
    for forced in (False, True):
        enc = _encoded_first_prompt(tokenizer, "A fix the failing test", forced)
        after[forced] = len(enc.ids) - enc.boundaries()["history"]
    return after[True] - after[False], after[True]


def new_session_bounds(tokenizer, page_size: int, first_messages: Sequence[tuple[str, int, str]],
                       checkpoints_only: bool = False) -> dict[tuple[str, int], tuple[int, int]]:
    """By ``(api, session)``, ``(page bound, restated bound)`` of each session's first request but
    the run's first: the prefix its first prompt shares with that of any session sent before it,
    in whole pages; the restated bound is the page bound, or with ``checkpoints_only`` (a model
    that resumes only at state checkpoints) the last boundary the renderer names within it (the
    tool declaration's end, the user message's opening tag), in whole pages.

    Args:
        tokenizer: the served model's tokenizer (its ``chat_format`` renders the prompts).
        page_size: tokens per page (>= 1).
        first_messages: ``(api, session, first user message)`` in the order the run sends them
            (:func:`kvtier.bench.agent_sessions.first_requests`).
        checkpoints_only: see above.

    Raises:
        ValueError: ``page_size`` < 1.
    """
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    out, earlier = {}, []
    for api, session, content in first_messages:
        enc = _encoded_first_prompt(tokenizer, content)
        ids = list(enc.ids)
        if earlier:
            shared = max(_common_prefix(ids, other) for other in earlier)
            page = shared // page_size * page_size
            marks = [b // page_size * page_size for b in enc.boundaries().values() if b <= shared]
            out[(api, session)] = (page, max(marks, default=0) if checkpoints_only else page)
        earlier.append(ids)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def annotate(rows: list[dict], page_size: int, new_session: dict[tuple[str, int], tuple[int, int]] | None,
             tail: tuple[int, int] | None = None) -> list[dict]:
    """``rows`` (one per request, from :func:`kvtier.bench.agent_sessions.run_agents`) with
    ``kind``, ``reachable_tokens`` (the page bound), ``after_tail`` (the previous prompt had a
    format tail; None where there is no previous turn), ``restated_tokens``, ``ratio`` and
    ``restated_ratio`` (None where nothing is reachable), ``reached_checkpoint`` (cached >= the
    restated bound; None where not counted) and ``lost`` (``text`` and ``tool`` rows: no token past
    the previous prompt's last whole page was cached; else None) added (module docstring). The
    run's first request is the first row; a row with ``error`` (:func:`kvtier.bench.agent_sessions.run_session`)
    is of kind ``error`` and not counted.

    Args:
        rows: see above.
        page_size: tokens per page.
        new_session: :func:`new_session_bounds` (None: new sessions are not counted).
        tail: :func:`prompt_tail` (None or a zero tail: no turn is after a tail).
    """
    out, prev = [], {}
    tail_ids, after_history = tail if tail else (0, 0)
    for i, row in enumerate(rows):
        key = (row["api"], row["session"])
        if row.get("error") is not None:  # refused or failed: no usage, the session ended there
            out.append({**row, "kind": "error", "reachable_tokens": None, "after_tail": None, "restated_tokens": None,
                        "ratio": None, "restated_ratio": None, "reached_checkpoint": None, "lost": None})
            continue
        lost = after = None
        if i == 0:
            kind, reach, restated = "first", None, None
        elif row["turn"] == 0:
            kind, (reach, restated) = "new-session", (new_session or {}).get(key, (None, None))
        else:
            p = prev[key]
            kind = "tool" if p["tool_calls"] else "text"
            reach = reachable_tokens(p["prompt_tokens"], p["output_tokens"], page_size)
            after = bool(p["forced"] and tail_ids > 0)
            restated = restated_tokens(p["prompt_tokens"], after_history, page_size) if after else reach
            lost = row["cached_tokens"] <= p["prompt_tokens"] // page_size * page_size
        cached = row["cached_tokens"]
        out.append({**row, "kind": kind, "reachable_tokens": reach, "after_tail": after, "restated_tokens": restated,
                    "ratio": cached / reach if reach else None,
                    "restated_ratio": cached / restated if restated else None,
                    "reached_checkpoint": cached >= restated if reach else None, "lost": lost})
        prev[key] = row
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (api, kind) with counted rows: ``turns``, ``cached_tokens``,
    ``reachable_tokens`` and ``restated_tokens`` (sums), ``ratio`` and ``restated_ratio`` (cached
    over each), ``min_ratio``, ``full_turns`` (rows at >= :data:`FULL` of the page bound),
    ``after_tail`` (rows whose previous prompt had a format tail), ``reached_checkpoint`` (rows at
    their restated bound) and ``lost_turns`` (rows ``lost``); then one per kind over every API
    (``api`` ``"all"``)."""
    groups = defaultdict(list)
    for r in rows:
        if r["ratio"] is not None:
            groups[(r["api"], r["kind"])].append(r)
            groups[("all", r["kind"])].append(r)
    apis = list(dict.fromkeys(r["api"] for r in rows)) + ["all"]
    out = []
    for api in apis:
        for kind in KINDS:
            g = groups.get((api, kind))
            if not g:
                continue
            cached, reach = sum(r["cached_tokens"] for r in g), sum(r["reachable_tokens"] for r in g)
            restated = sum(r["restated_tokens"] for r in g)
            out.append({"api": api, "kind": kind, "turns": len(g), "cached_tokens": cached,
                        "reachable_tokens": reach, "ratio": cached / reach, "min_ratio": min(r["ratio"] for r in g),
                        "full_turns": sum(r["ratio"] >= FULL for r in g), "restated_tokens": restated,
                        "restated_ratio": cached / restated if restated else None,
                        "after_tail": sum(bool(r["after_tail"]) for r in g),
                        "reached_checkpoint": sum(bool(r["reached_checkpoint"]) for r in g),
                        "lost_turns": sum(bool(r["lost"]) for r in g)})
    return out


def _restated(s: dict) -> str:
    return "-" if s["restated_ratio"] is None else f"{s['restated_ratio']:.3f}"


def markdown_table(summary: list[dict]) -> str:
    """``summary`` as a Markdown table (the form docs/benchmarks.md keeps)."""
    lines = ["| API | reused turn | turns | cached / reachable tokens | ratio | restated bound | restated ratio | "
             "lowest turn | turns >= 0.99 | turns after a tail | turns at their checkpoint | turns lost whole |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['api']} | {s['kind']} | {s['turns']} | {s['cached_tokens']} / {s['reachable_tokens']} | "
                     f"{s['ratio']:.3f} | {s['restated_tokens']} | {_restated(s)} | {s['min_ratio']:.3f} | "
                     f"{s['full_turns']} / {s['turns']} | {s['after_tail']} / {s['turns']} | "
                     f"{s['reached_checkpoint']} / {s['turns']} | {s['lost_turns']} / {s['turns']} |")
    return "\n".join(lines)


def print_report(console, summary: list[dict], title: str) -> None:
    """``summary`` as a rich table on ``console``, whole in 80 columns (the token sums are in the
    JSON and :func:`markdown_table`): ``ratio`` cached over the page bound, ``r.ratio`` over the
    restated bound, ``lowest`` the lowest turn's ratio, ``full`` turns at >= 0.99 of the page
    bound, ``ckpt`` turns at their restated bound, ``lost`` turns lost whole; each of the group's
    turns."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE, pad_edge=False, collapse_padding=True)
    widths = {"API": len("responses"), "reused turn": len("new-session"), "full": 7, "ckpt": 7, "lost": 7}
    for col in ("API", "reused turn", "ratio", "r.ratio", "lowest", "full", "ckpt", "lost"):
        t.add_column(col, justify="left" if col in ("API", "reused turn") else "right", no_wrap=True,
                     min_width=max(len(col), widths.get(col, 0)))
    for s in summary:
        n = s["turns"]
        t.add_row(s["api"], s["kind"], f"{s['ratio']:.3f}", _restated(s), f"{s['min_ratio']:.3f}",
                  f"{s['full_turns']}/{n}", f"{s['reached_checkpoint']}/{n}", f"{s['lost_turns']}/{n}")
    console.print(t)


def agent_json(rows: list[dict], summary: list[dict], provenance: dict) -> dict:
    """The run as JSON: ``provenance`` (:func:`kvtier.provenance.provenance`, taken when the run
    started: commit, machine, time and the run's settings), the summary and every row."""
    return {"provenance": provenance, "summary": summary, "turns": rows}
