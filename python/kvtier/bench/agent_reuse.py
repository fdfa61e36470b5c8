"""The reuse report of ``kvtier bench --workload sdk-agents`` (sessions:
:mod:`kvtier.bench.agent_sessions`): per turn, the cached tokens the server reported divided by
the tokens it could have found, by API and by what the reused turn was.

Reachable tokens of turn k >= 1 of a session: the previous turn's prompt and output whose KV
was computed, in whole pages::

    reachable_k = floor((prompt_{k-1} + output_{k-1} - 1) / page_size) * page_size

(the last sampled token is never run through the model, so its KV does not exist; the next
turn's prompt starts with all of turn k-1 when the client sends back what it got). The row's
``kind`` is what turn k-1 produced: ``tool`` (it made tool calls, and turn k carries their
results) or ``text``. A new session (turn 0 of every session but the run's first) can reach
the prefix it shares with the sessions before it, the same system prompt and tools
(``new-session``): the common prefix of two first prompts, rendered in the served tokenizer's
chat format (K2's template or K3's XTML) and encoded, in whole pages
(:func:`shared_prefix_tokens`; None, and the row not counted, without a tokenizer). The run's
first request reaches nothing (``first``, not counted).

``ratio = cached / reachable`` per row; a group's ratio is sum(cached) / sum(reachable), with
the lowest row ratio, the rows at >= 0.99 and the turns lost whole beside it: rows of ``text``
and ``tool`` whose cached tokens stop at or before the previous prompt's last whole page, so
nothing turn k-1 generated came back (``lost_turns``).
"""

from __future__ import annotations

from collections import defaultdict

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


def _first_prompt_ids(tokenizer, content: str) -> list[int]:
    """The ids of a first prompt (system prompt, tools, one user message ``content``) in
    ``tokenizer``'s chat format: K2's template or K3's XTML."""
    from kvtier.bench.agent_sessions import SYSTEM, ChatDriver
    from kvtier.tokenize import ChatFormat, render_chat

    messages, tools = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}], \
        ChatDriver(None, "").tools
    if getattr(tokenizer, "chat_format", ChatFormat.K2_TEMPLATE) is ChatFormat.K3_XTML:
        from kvtier.tokenize.xtml import encode_xtml

        return encode_xtml(tokenizer, messages, tools)
    return tokenizer.encode(render_chat(messages, tools))


def shared_prefix_tokens(tokenizer, page_size: int) -> int | None:
    """Tokens every session's first prompt shares (tool declaration, system prompt and the user
    turn's opening), in whole pages: the common prefix of two first prompts whose messages differ
    from their first character, in the tokenizer's chat format. None without a tokenizer."""
    if tokenizer is None:
        return None
    a, b = (_first_prompt_ids(tokenizer, f"{c} fix the failing test") for c in ("A", "Z"))
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n // page_size * page_size


def annotate(rows: list[dict], page_size: int, shared_prefix: int | None) -> list[dict]:
    """``rows`` (one per request, from :func:`kvtier.bench.agent_sessions.run_agents`) with
    ``kind``, ``reachable_tokens``, ``ratio`` (None where nothing is reachable) and ``lost``
    (``text`` and ``tool`` rows: no token past the previous prompt's last whole page was cached;
    else None) added. The run's first request is the first row."""
    out, prev = [], {}
    for i, row in enumerate(rows):
        key = (row["api"], row["session"])
        lost = None
        if i == 0:
            kind, reach = "first", None
        elif row["turn"] == 0:
            kind, reach = "new-session", shared_prefix
        else:
            p = prev[key]
            kind = "tool" if p["tool_calls"] else "text"
            reach = reachable_tokens(p["prompt_tokens"], p["output_tokens"], page_size)
            lost = row["cached_tokens"] <= p["prompt_tokens"] // page_size * page_size
        ratio = row["cached_tokens"] / reach if reach else None
        out.append({**row, "kind": kind, "reachable_tokens": reach, "ratio": ratio, "lost": lost})
        prev[key] = row
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (api, kind) with counted rows: ``turns``, ``cached_tokens``,
    ``reachable_tokens`` (sums), ``ratio`` (their quotient), ``min_ratio``, ``full_turns``
    (rows at >= :data:`FULL`) and ``lost_turns`` (rows ``lost``); then one per kind over every API
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
            out.append({"api": api, "kind": kind, "turns": len(g), "cached_tokens": cached,
                        "reachable_tokens": reach, "ratio": cached / reach, "min_ratio": min(r["ratio"] for r in g),
                        "full_turns": sum(r["ratio"] >= FULL for r in g),
                        "lost_turns": sum(bool(r["lost"]) for r in g)})
    return out


def markdown_table(summary: list[dict]) -> str:
    """``summary`` as a Markdown table (the form docs/benchmarks.md keeps)."""
    lines = ["| API | reused turn | turns | cached / reachable tokens | ratio | lowest turn | turns >= 0.99 | "
             "turns lost whole |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['api']} | {s['kind']} | {s['turns']} | {s['cached_tokens']} / {s['reachable_tokens']} | "
                     f"{s['ratio']:.3f} | {s['min_ratio']:.3f} | {s['full_turns']} / {s['turns']} | "
                     f"{s['lost_turns']} / {s['turns']} |")
    return "\n".join(lines)


def print_report(console, summary: list[dict], title: str) -> None:
    """``summary`` as a rich table on ``console`` (``reach``: reachable tokens; ``full``: turns at
    >= 0.99; ``lost``: turns lost whole; both of the group's turns)."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE, pad_edge=False)
    widths = {"API": len("responses"), "reused turn": len("new-session")}  # whole in 80 columns
    for col in ("API", "reused turn", "cached", "reach", "ratio", "lowest", "full", "lost"):
        t.add_column(col, justify="left" if col in widths else "right", no_wrap=True,
                     min_width=max(len(col), widths.get(col, 0)))
    for s in summary:
        t.add_row(s["api"], s["kind"], str(s["cached_tokens"]), str(s["reachable_tokens"]),
                  f"{s['ratio']:.3f}", f"{s['min_ratio']:.3f}", f"{s['full_turns']}/{s['turns']}",
                  f"{s['lost_turns']}/{s['turns']}")
    console.print(t)


def agent_json(rows: list[dict], summary: list[dict], provenance: dict) -> dict:
    """The run as JSON: ``provenance`` (:func:`kvtier.provenance.provenance`, taken when the run
    started: commit, machine, time and the run's settings), the summary and every row."""
    return {"provenance": provenance, "summary": summary, "turns": rows}
