"""``kvtier bench --workload sdk-agents``: agent sessions driven through a server's HTTP APIs
with the official SDKs, measuring how much of each turn the next turn finds in the cache.

A coding agent sends its whole history back every turn, as its SDK returned it. Each session
here does the same, on one API:

- ``chat``: ``openai`` ``chat.completions.create``; the assistant turn goes back as
  ``message.model_dump()``, then one ``{"role": "tool"}`` message per call or a user message.
- ``messages``: ``anthropic`` ``messages.create`` (temperature in the body: the SDK has no
  argument for it); the assistant turn goes back as its content blocks (``model_dump()``), then
  a user turn of ``tool_result`` blocks or a user message.
- ``responses``: ``openai`` ``responses.create`` (``store=False``, the system prompt as
  ``instructions``); the ``response.output`` items go back (``model_dump()``), then one
  ``function_call_output`` per call or a user message.

Every session has the same system prompt and tools (three coding tools with small schemas) and
its own first user message, which starts with a tag hashed from the run's nonce, the API and
the session's index, so no session finds another's turns, nor a rerun against the same server
this run's. On a share of the turns (``tool_share``, spread evenly and shifted per session) tool
calls are forced (``tool_choice`` ``"required"`` / ``{"type": "any"}``); the other turns leave
the choice to the model (``"auto"``). Tool results and follow-up messages are drawn from a generator seeded by the run's
seed, session and turn. Requests are greedy (temperature 0), not streamed, ask for
``max_tokens`` output tokens and carry the session's id where its API's agents send one: the
``X-Session-Id`` header (chat), ``metadata.user_id`` (Messages), ``prompt_cache_key``
(Responses).

Scheduling: the first turn of the first session runs alone; then all (API, session) pairs run,
``concurrency`` sessions at a time, each session's turns one after the other.

What a turn reads is in :mod:`kvtier.bench.agent_reuse` (the reachable bound, the ratios and the
tables).
"""

from __future__ import annotations

import hashlib
import random
import secrets
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

APIS = ("chat", "messages", "responses")

SYSTEM = ("You are a coding agent working in a Python repository. Use the tools to read files, run commands "
          "and edit code; answer briefly once the task is done.")

TOOLS = (  # one neutral declaration each, given to every API in its own shape
    ("read_file", "Read a file of the repository",
     {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}},
      "required": ["path"], "additionalProperties": False}),
    ("run_command", "Run a shell command in the repository root",
     {"type": "object", "properties": {"command": {"type": "string", "maxLength": 32}},
      "required": ["command"], "additionalProperties": False}),
    ("edit_file", "Replace one line of a file",
     {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24},
                                       "line": {"type": "integer", "minimum": 1, "maximum": 999}},
      "required": ["path", "line"], "additionalProperties": False}),
)


@dataclass(frozen=True)
class AgentWorkload:
    """What ``--workload sdk-agents`` runs.

    Args:
        sessions: sessions per API (>= 1).
        turns: requests per session (>= 1).
        apis: a non-empty subset of :data:`APIS`, in the order they run.
        tool_share: share of turns with tool calls forced, in [0, 1] (0.5: every other turn).
        max_tokens: output tokens asked per turn (>= 1).
        concurrency: sessions running at once (>= 1).
        seed: the tool results and follow-up messages.
        send_session_id: send each session's id (module docstring).

    Raises:
        ValueError: a field outside its range, naming its ``kvtier bench`` option.
    """

    sessions: int = 4
    turns: int = 6
    apis: tuple[str, ...] = APIS
    tool_share: float = 0.5
    max_tokens: int = 64
    concurrency: int = 4
    seed: int = 0
    send_session_id: bool = True

    def __post_init__(self):
        for name, option in (("sessions", "--agent-sessions"), ("turns", "--agent-turns"),
                             ("max_tokens", "--max-output-tokens"), ("concurrency", "--concurrency")):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be an integer >= 1, got {value!r}")
        if not self.apis or set(self.apis) - set(APIS) or len(set(self.apis)) != len(self.apis):
            raise ValueError(f"--agent-apis must be distinct names out of {','.join(APIS)}, "
                             f"got {','.join(self.apis)!r}")
        if not 0.0 <= self.tool_share <= 1.0:
            raise ValueError(f"--agent-tool-share must be in [0, 1], got {self.tool_share!r}")

    def forced(self, session: int, turn: int) -> bool:
        """Whether turn ``turn`` of session ``session`` forces tool calls: the turns where
        ``floor((turn + session + 1) * share)`` steps up, so a share s forces s of every run of
        turns, evenly spread."""
        k = turn + session
        return int((k + 1) * self.tool_share) > int(k * self.tool_share)


@dataclass
class TurnUsage:
    """One response as its API's usage reports it (tokens).

    prompt_tokens: the whole prompt (chat ``prompt_tokens``; Messages ``input_tokens`` +
        ``cache_read_input_tokens`` + ``cache_creation_input_tokens``; Responses
        ``input_tokens``). output_tokens: tokens generated. cached_tokens: prompt tokens read from
        the cache (chat ``prompt_tokens_details.cached_tokens``; Messages
        ``cache_read_input_tokens``; Responses ``input_tokens_details.cached_tokens``; 0 when the
        server leaves it out). tool_calls: calls in the response. finish: the API's stop reason.
    """

    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    tool_calls: int
    finish: str


def tool_result(rng: random.Random, name: str) -> str:
    """A plausible output of tool ``name``: 2-10 lines drawn from ``rng``."""
    n = rng.randint(2, 10)
    if name == "read_file":
        return "\n".join(f"{i + 1}: {rng.choice(['def', 'return', 'if', 'for'])} v{rng.randint(0, 999)} = "
                         f"f{rng.randint(0, 99)}(x)" for i in range(n))
    if name == "run_command":
        return "\n".join(f"tests/test_m{rng.randint(0, 50)}.py::test_{rng.randint(0, 200)} "
                         f"{rng.choice(['PASSED', 'FAILED'])}" for _ in range(n))
    return f"edited line {rng.randint(1, 999)}; {n} lines changed"


def follow_up(rng: random.Random) -> str:
    """A user's next instruction, drawn from ``rng``."""
    return (f"Now {rng.choice(['also handle', 'add a test for', 'explain', 'simplify'])} the case "
            f"{rng.randint(0, 9999)} in module m{rng.randint(0, 50)}.py.")


def first_message(nonce: str, api: str, session: int) -> str:
    """The first user message of session ``session`` of ``api``: it starts with a tag hashed from
    the run's ``nonce``, the API and the session, so no two sessions share a token after the
    system prompt and tools (but by chance the tags' first token)."""
    tag = hashlib.sha256(f"{nonce}:{api}:{session}".encode()).hexdigest()[:8]
    return f"{tag}: fix the failing test in module m{session}.py and report what changed."


# ---- one driver per API: the first request's history, one call, the history it extends to ----

class ChatDriver:
    """``openai`` chat completions."""

    api = "chat"

    def __init__(self, client, model: str):
        self.client, self.model = client, model
        self.tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
                      for n, d, p in TOOLS]

    def start(self, user: str) -> list:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def call(self, history: list, forced: bool, max_tokens: int, session_id: str | None):
        r = self.client.chat.completions.create(model=self.model, messages=history, tools=self.tools,
                                                tool_choice="required" if forced else "auto", temperature=0,
                                                max_tokens=max_tokens,
                                                extra_headers={"X-Session-Id": session_id} if session_id else None)
        u, msg = r.usage, r.choices[0].message
        details = u.prompt_tokens_details
        calls = list(msg.tool_calls or [])
        usage = TurnUsage(u.prompt_tokens, u.completion_tokens, (details.cached_tokens or 0) if details else 0,
                          len(calls), r.choices[0].finish_reason)
        return usage, msg, [(c.id, c.function.name) for c in calls]

    def extend(self, history: list, reply, results: list[tuple[str, str]] | None, user: str | None) -> list:
        out = history + [reply.model_dump()]
        if results:
            return out + [{"role": "tool", "tool_call_id": cid, "content": text} for cid, text in results]
        return out + [{"role": "user", "content": user}]


class MessagesDriver:
    """``anthropic`` Messages."""

    api = "messages"

    def __init__(self, client, model: str):
        self.client, self.model = client, model
        self.tools = [{"name": n, "description": d, "input_schema": p} for n, d, p in TOOLS]

    def start(self, user: str) -> list:
        return [{"role": "user", "content": user}]

    def call(self, history: list, forced: bool, max_tokens: int, session_id: str | None):
        kw = {"metadata": {"user_id": session_id}} if session_id else {}
        r = self.client.messages.create(model=self.model, system=SYSTEM, messages=history, tools=self.tools,
                                        tool_choice={"type": "any"} if forced else {"type": "auto"},
                                        max_tokens=max_tokens, extra_body={"temperature": 0}, **kw)
        u = r.usage
        uses = [b for b in r.content if b.type == "tool_use"]
        prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
        usage = TurnUsage(prompt, u.output_tokens, u.cache_read_input_tokens or 0, len(uses), r.stop_reason)
        return usage, r.content, [(b.id, b.name) for b in uses]

    def extend(self, history: list, reply, results: list[tuple[str, str]] | None, user: str | None) -> list:
        out = history + [{"role": "assistant", "content": [b.model_dump() for b in reply]}]
        if results:
            return out + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": text}
                                                       for cid, text in results]}]
        return out + [{"role": "user", "content": user}]


class ResponsesDriver:
    """``openai`` Responses."""

    api = "responses"

    def __init__(self, client, model: str):
        self.client, self.model = client, model
        self.tools = [{"type": "function", "name": n, "description": d, "parameters": p, "strict": True}
                      for n, d, p in TOOLS]

    def start(self, user: str) -> list:
        return [{"role": "user", "content": user}]

    def call(self, history: list, forced: bool, max_tokens: int, session_id: str | None):
        kw = {"prompt_cache_key": session_id} if session_id else {}
        r = self.client.responses.create(model=self.model, instructions=SYSTEM, input=history, tools=self.tools,
                                         tool_choice="required" if forced else "auto", temperature=0, store=False,
                                         max_output_tokens=max_tokens, **kw)
        u = r.usage
        calls = [o for o in r.output if o.type == "function_call"]
        details = u.input_tokens_details
        usage = TurnUsage(u.input_tokens, u.output_tokens, (details.cached_tokens or 0) if details else 0,
                          len(calls), r.status)
        return usage, r.output, [(c.call_id, c.name) for c in calls]

    def extend(self, history: list, reply, results: list[tuple[str, str]] | None, user: str | None) -> list:
        out = history + [o.model_dump() for o in reply]
        if results:
            return out + [{"type": "function_call_output", "call_id": cid, "output": text} for cid, text in results]
        return out + [{"role": "user", "content": user}]


DRIVERS = {"chat": ChatDriver, "messages": MessagesDriver, "responses": ResponsesDriver}


def make_driver(api: str, url: str, model: str, timeout_s: float = 600.0):
    """The driver of ``api`` over the server at ``url`` (its root, or an OpenAI ``base_url``
    ending in ``/v1``)."""
    root = url.rstrip("/").removesuffix("/v1")
    if api == "messages":
        import anthropic

        client = anthropic.Anthropic(base_url=root, api_key="none", max_retries=0, timeout=timeout_s)
    else:
        import openai

        client = openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0, timeout=timeout_s)
    return DRIVERS[api](client, model)


def run_session(driver, workload: AgentWorkload, nonce: str, session: int, turns: range,
                history: list | None = None) -> tuple[list[dict], list]:
    """Turns ``turns`` of session ``session`` through ``driver``; returns one row per turn
    (``api``, ``session``, ``turn``, ``forced``, and :class:`TurnUsage`'s fields) and the history
    the last turn extended to (where a later call of this function goes on). A turn the server
    answers with an HTTP error (a refused or failed request) ends the session: its row holds
    ``error`` (status and message) instead of the usage, and the history returned is None."""
    if history is None:
        history = driver.start(first_message(nonce, driver.api, session))
    sid = f"{nonce}-{driver.api}-{session}" if workload.send_session_id else None
    rows = []
    for k in turns:
        forced = workload.forced(session, k)
        row = {"api": driver.api, "session": session, "turn": k, "forced": forced}
        try:
            usage, reply, calls = driver.call(history, forced, workload.max_tokens, sid)
        except Exception as e:  # the SDKs' APIStatusError: the server answered with an error
            if getattr(e, "status_code", None) is None:
                raise
            rows.append({**row, "error": f"{e.status_code}: {str(e)[:300]}"})
            return rows, None
        rows.append({**row, **vars(usage)})
        rng = random.Random(f"{workload.seed}:{driver.api}:{session}:{k}")
        results = [(cid, tool_result(rng, name)) for cid, name in calls]
        history = driver.extend(history, reply, results, None if results else follow_up(rng))
    return rows, history


def first_requests(workload: AgentWorkload, nonce: str) -> list[tuple[str, int, str]]:
    """``(api, session, first user message)`` of every session, in the order :func:`run_agents`
    sends them: the first API's session 0 alone, then the others by API and session."""
    head = (workload.apis[0], 0)
    order = [head] + [(api, s) for api in workload.apis for s in range(workload.sessions) if (api, s) != head]
    return [(api, s, first_message(nonce, api, s)) for api, s in order]


def run_agents(url: str, model: str, workload: AgentWorkload, nonce: str | None = None,
               on_session: Callable[[str, int], None] | None = None) -> list[dict]:
    """Run ``workload`` against the server at ``url`` serving ``model``.

    The first turn of the first API's session 0 runs alone (every later session finds the
    shared system prompt and tools from it); then every (API, session) runs, ``concurrency`` at
    once. ``nonce``: hashed into every first message's tag, and the prefix of every session id
    (default: 8 random hex digits). ``on_session(api, session)`` is called as each session ends.

    Returns:
        one row per request (:func:`run_session`; a turn the server answered with an error holds
        ``error`` and ends its session), ordered by API, session and turn.

    Raises:
        what the SDKs raise for a server that does not answer (``openai.APIConnectionError``,
        ``anthropic.APIConnectionError``, timeouts).
    """
    nonce = nonce or secrets.token_hex(4)
    drivers = {api: make_driver(api, url, model) for api in workload.apis}
    first = workload.apis[0]
    head, head_history = run_session(drivers[first], workload, nonce, 0, range(1))

    def one(api: str, session: int) -> list[dict]:
        if (api, session) == (first, 0):
            rows = [] if head_history is None else \
                run_session(drivers[api], workload, nonce, 0, range(1, workload.turns), head_history)[0]
            rows = head + rows
        else:
            rows, _ = run_session(drivers[api], workload, nonce, session, range(workload.turns))
        if on_session is not None:
            on_session(api, session)
        return rows

    jobs = [(api, s) for api in workload.apis for s in range(workload.sessions)]
    with ThreadPoolExecutor(max_workers=workload.concurrency) as pool:
        done = list(pool.map(lambda job: one(*job), jobs))
    return [row for rows in done for row in rows]


def eviction_counts(url: str, timeout_s: float = 10.0) -> dict | None:
    """``{series: {tier: n}}`` of every ``kvtier_*evictions_total`` series of the server's Prometheus
    ``/metrics`` (each kind of cached object the pool drops to make room, by tier: blocks as
    ``kvtier_evictions_total``, ...); None when it does not answer or counts none (another server)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(f"{url.rstrip('/').removesuffix('/v1')}/metrics", timeout=timeout_s)
        r.raise_for_status()
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    out: dict[str, dict[str, int]] = {}
    for fam in families:
        for sample in fam.samples:
            if sample.name.startswith("kvtier_") and sample.name.endswith("evictions_total"):
                out.setdefault(sample.name, {})[sample.labels.get("tier", "")] = int(sample.value)
    return out if any(out.values()) else None


def _evicted_during(url: str, before: dict | None) -> dict | None:
    """What the server's eviction counters (:func:`eviction_counts`) added since ``before``."""
    after = eviction_counts(url)
    if before is None or after is None:
        return None
    return {name: {t: n - before.get(name, {}).get(t, 0) for t, n in tiers.items()} for name, tiers in after.items()}


@contextmanager
def local_server(model: str, tokenizer: str | None, server_args: list[str]):
    """``kvtier serve MODEL --tokenizer DIR SERVER_ARGS`` as a child process on a free loopback
    port; yields it (a :class:`kvtier.cluster.launch.WorkerProcess`: ``url``, ``proc``, ``log``) and
    stops it by PID (SIGTERM, then SIGKILL) on exit. The log goes to a
    temporary file, printed in the error when the server does not start.

    Raises:
        kvtier.cluster.StartupError: the server exited or did not answer ``/health`` in time.
    """
    from kvtier.cluster.launch import spawn_worker, wait_worker

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-") as tmp:
        args = (["--tokenizer", tokenizer] if tokenizer else []) + server_args
        worker = wait_worker(spawn_worker(model, args, Path(tmp) / "serve.log"), Path(tmp) / "serve.log")
        try:
            yield worker
        finally:
            worker.stop()


def served_tokenizer(model: str, tokenizer: str | None):
    """``(tokenizer, hybrid)``: the tokenizer files at ``tokenizer`` loaded in the chat format
    ``model`` speaks, as ``kvtier serve`` loads them (K3's XTML for a ``kimi_k3`` config, over K2's
    files), and whether ``model`` is a hybrid KDA + MLA model (it resumes only at state
    checkpoints). A ``model`` that is neither a preset nor a checkpoint here (a name another server
    serves) gives the files' own format and False. ``(None, hybrid)`` without ``tokenizer``.

    Raises:
        what :func:`kvtier.tokenize.load_tokenizer` raises.
    """
    from kvtier.model.kimi_linear_config import KimiLinearConfig
    from kvtier.model.plan_report import model_config
    from kvtier.tokenize import load_tokenizer
    from kvtier.tokenize.formats import model_chat_format

    try:
        config, _ = model_config(model)
    except ValueError:
        config = None
    hybrid = isinstance(config, KimiLinearConfig)
    if tokenizer is None:
        return None, hybrid
    return load_tokenizer(tokenizer, model_chat_format(config.model_type) if config is not None else None), hybrid


def bench_agents(workload: AgentWorkload, *, model: str, tokenizer: str | None, page_size: int,
                 endpoint: str | None = None, server_args: tuple[str, ...] = (), console=None,
                 json_path: str | None = None) -> dict:
    """Run ``workload`` against ``endpoint`` (a server's root or OpenAI ``base_url``), or against a
    ``kvtier serve MODEL --page-size PAGE_SIZE SERVER_ARGS`` started for the run (:func:`local_server`),
    and report the reuse (:mod:`kvtier.bench.agent_reuse`): printed on ``console`` (a rich
    Console; None: silent) and written to ``json_path`` with provenance.

    ``tokenizer``: the served model's tokenizer directory, loaded in the model's chat format
    (:func:`served_tokenizer`), for the bounds the renderer gives (new sessions' shared prefix,
    the tail of forced turns; None: new sessions are not counted and no turn is after a tail) and
    the local server.

    Returns:
        ``{"provenance", "summary", "turns"}`` (:func:`kvtier.bench.agent_reuse.agent_json`); the
        provenance holds the run's ``nonce`` (its first messages, :func:`first_requests`), the
        ``chat_format``, ``hybrid`` and ``prompt_tail`` (:func:`kvtier.bench.agent_reuse.prompt_tail`)
        the bounds were computed with, and ``evicted_during_run``: what the server's eviction
        counters added during the run (:func:`eviction_counts`; None for a server without them):
        a turn can lose pages to capacity as well as to re-encoding; ``failed_turns``: turns the
        server answered with an error (:func:`run_session`).

    Raises:
        ValueError: a bad page size; what :func:`run_agents` and :func:`local_server` raise.
    """
    from kvtier.bench import agent_reuse
    from kvtier.bench.report import write_json
    from kvtier.provenance import provenance

    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"--page-size must be an integer >= 1, got {page_size!r}")
    tok, hybrid = served_tokenizer(model, tokenizer)
    nonce = secrets.token_hex(4)
    tail = agent_reuse.prompt_tail(tok)
    bounds = (agent_reuse.new_session_bounds(tok, page_size, first_requests(workload, nonce), checkpoints_only=hybrid)
              if tok is not None else None)
    where = endpoint or f"kvtier serve {model} (started for the run)"
    settings = {**asdict(workload), "apis": list(workload.apis)}
    # taken before the run: the commit is that of the code the run (and a server it starts) loads
    prov = provenance(endpoint=where, model=model, tokenizer=tokenizer, page_size=page_size, nonce=nonce,
                      chat_format=getattr(getattr(tok, "chat_format", None), "value", None), hybrid=hybrid,
                      prompt_tail={"tail": tail[0], "after_history": tail[1]} if tail else None,
                      workload=settings, server_args=list(server_args))
    ended = []

    def progress(api: str, session: int) -> None:
        ended.append((api, session))
        if console is not None:
            console.log(f"{api} session {session} done ({len(ended)} of {workload.sessions * len(workload.apis)})")
    if endpoint is not None:
        before = eviction_counts(endpoint)
        rows = run_agents(endpoint, model, workload, nonce, on_session=progress)
        evicted = _evicted_during(endpoint, before)
    else:
        with local_server(model, tokenizer, ["--page-size", str(page_size), *server_args]) as server:
            before = eviction_counts(server.url)
            rows = run_agents(server.url, model, workload, nonce, on_session=progress)
            evicted = _evicted_during(server.url, before)
    rows = agent_reuse.annotate(rows, page_size, bounds, tail)
    summary = agent_reuse.summarize(rows)
    failed = sum(r.get("error") is not None for r in rows)
    result = agent_reuse.agent_json(rows, summary, {**prov, "evicted_during_run": evicted, "failed_turns": failed})
    if console is not None:
        if failed:
            console.log(f"{failed} turns answered with an error (each ended its session; rows of kind 'error')")
        agent_reuse.print_report(console, summary, f"cached / reachable tokens per turn: {model} via {where}")
    if json_path:
        write_json(json_path, result)
    return result
