"""Sessions of the server: one incremental encoder per session id (chat), tool waits told to the
pool, an idle TTL. Used on the engine thread only (no locking). A session, and the
``cache_salt`` it keeps, starts with its first request the engine accepts: a refused request
leaves none behind.

When a session's turn ends in tool calls, the pool is told the session is waiting on a tool
(``KVPool.tool_wait`` with the turn's prompt and output tokens) for an expected time: the
client's hint (``expected_tool_wait_s``) if it gave one, else the largest running estimate of
the called tools (median of the waits seen for that tool name on this server, 9 s before any,
docs/workload.md's p50). A text completion of a session that carries ``expected_tool_wait_s``
declares such a wait itself (tool name :data:`DECLARED_WAIT`). The wait ends when the session's
next request is accepted by the engine (the wait is then observed for those tools; a refused
request leaves it waiting, and one aborted after it was accepted, a client that disconnected,
gives it back), when it is deleted, or when it expires.

A chat turn's sampled ids stay in its session (:meth:`SessionStore.generated`): the session's
encoder keeps them for the assistant message the API returned, so the next turn that sends that
message back (however the client serialised it) holds the ids the cache holds. A chat request with
no session id finds the session of an earlier one by content: the conversation it sends, up to an
assistant message, equals one an earlier turn was prompted with followed by the message it
generated (same ``cache_salt``); a turn whose ids are not kept (a length stop leaves K3's message
open, a stop string cuts it) is filed all the same, under the message returned, for the prompt's
ids (and the turns kept before it) that the next turn starts with. The store is bounded: past ``max_tokens`` ids in all its
encoders, the least recently used sessions with no request in flight are evicted (counted in
``num_evicted``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.cache.block_hash import block_hashes
from kvtier.cache.eviction import ToolWaitEstimate
from kvtier.serve.api.protocol import ApiError
from kvtier.serve.api.resume import ResumeTracker
from kvtier.serve.chat import new_encoder
from kvtier.serve.engine import Engine, request_salt
from kvtier.tokenize.sampled import message_key

DEFAULT_TOOL_WAIT_S = 9.0  # docs/workload.md: think time after tool_use, p50
DEFAULT_SESSION_STORE_TOKENS = 1 << 25  # ids kept by all sessions' encoders (32M: ~128 MB of ids)
DECLARED_WAIT = "(declared)"  # the tool name of a wait a text completion's client declared


@dataclass
class Session:
    """One session's encoder and tool-wait state (times from the store's clock, seconds)."""

    encoder: object
    last_used_s: float
    waiting_since_s: float | None = None
    waiting_tools: list[str] = field(default_factory=list)
    in_flight: int = 0
    cache_salt: str = ""
    accepted: bool = False  # a request of the session reached the engine
    waiting_ids: list | None = None  # prompt and output of the turn it waits after (for the resume target)
    waiting_hashes: list = field(default_factory=list)  # that turn's full pages, as told to the pool
    waiting_expected_s: float = 0.0  # the wait the pool was told to expect
    resumed: _Wait | None = None  # the wait its request in flight ended (given back if that one is aborted)


@dataclass
class _Wait:
    """A tool wait a resuming request ended, kept until that request's turn ends."""

    since_s: float
    tools: list[str]
    ids: list | None
    hashes: list
    expected_s: float
    observed: list[tuple[str, float]]  # (tool, seconds) appended to the tools' estimates


class SessionStore:
    """Sessions by id, over one engine.

    Args:
        engine: the engine whose pool hears about tool waits.
        tokenizer: for the sessions' encoders.
        ttl_s: a session unused this long (and with no request in flight) is dropped.
        clock: seconds, monotonic.
        max_tokens: the ids all sessions' encoders may hold (``--session-store-tokens``); past it
            the least recently used idle sessions are evicted.

    Raises:
        ValueError: ``ttl_s`` or ``max_tokens`` not positive.
    """

    def __init__(self, engine: Engine, tokenizer, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 max_tokens: int = DEFAULT_SESSION_STORE_TOKENS):
        if not 0 < ttl_s:
            raise ValueError(f"session ttl_s must be > 0, got {ttl_s!r}")
        self.engine, self.tokenizer, self.ttl_s, self.clock = engine, tokenizer, ttl_s, clock
        self.set_max_tokens(max_tokens)
        self.num_evicted = 0
        self.sessions: dict[str, Session] = {}
        # encoders of requests with no session id, by the conversation their next turn starts with
        self.by_content: OrderedDict[bytes, tuple[object, float]] = OrderedDict()
        self.tool_waits: dict[str, ToolWaitEstimate] = {}
        self.num_expired = 0
        self.resumes = ResumeTracker(engine.config.pool.page_size, prefill_s=engine.prefill_time_s)  # --resume-ttft-s

    def set_max_tokens(self, max_tokens: int) -> None:
        """Bound the ids all sessions' encoders hold (evicting at the next turn's end).

        Raises:
            ValueError: naming ``session_store_tokens`` when not an int > 0.
        """
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"session_store_tokens must be an int > 0, got {max_tokens!r}")
        self.max_tokens = max_tokens

    def encoder(self, session_id: str | None, cache_salt: str = "", messages=None):
        """The session's encoder (created on first use). For None: the encoder of an earlier
        request with no session id whose conversation and generated message ``messages`` (a chat
        request's, when given) continue, with the same ``cache_salt`` (taken out of the store
        until :meth:`generated` files it again), else a new one. A session waiting on a tool goes
        on waiting until a request of it is :meth:`accepted` (a refused one, say over the
        context, leaves the wait, its blocks' plan and the resume to the retry).

        Raises:
            ApiError: 400 when ``cache_salt`` differs from the one the session started with.
        """
        if session_id is None:
            found = self._take_by_content(messages, cache_salt) if messages is not None else None
            return found if found is not None else new_encoder(self.engine, self.tokenizer, cache_salt)
        now = self.clock()
        s = self.sessions.get(session_id)
        if s is None:
            s = self.sessions[session_id] = Session(new_encoder(self.engine, self.tokenizer, cache_salt), now,
                                                    cache_salt=cache_salt)
        elif s.cache_salt != cache_salt:
            raise ApiError(400, f"cache_salt: session {session_id!r} was started with another cache_salt; "
                           "a session keeps one", "cache_salt")
        s.last_used_s = now
        s.in_flight += 1
        return s.encoder

    def refused(self, session_id: str | None) -> None:
        """A request of ``session_id`` taken by :meth:`encoder` was refused before reaching the
        engine. A session none of whose requests was accepted is dropped (a refused request
        starts no session, so its ``cache_salt`` binds nothing)."""
        self.resumes.end(session_id, None)
        s = self.sessions.get(session_id) if session_id is not None else None
        if s is None:
            return
        s.in_flight = max(s.in_flight - 1, 0)
        if not s.accepted and not s.in_flight:
            del self.sessions[session_id]

    def accepted(self, session_id: str | None, prompt_ids=None) -> None:
        """A request of ``session_id`` taken by :meth:`encoder` reached the engine with
        ``prompt_ids`` (None: the session encoder's ids, a chat request's). A session waiting on a
        tool stops waiting: the pool is told, the wait is observed for the tool's estimate, and the
        request is the resume the target counts."""
        s = self.sessions.get(session_id) if session_id is not None else None
        if s is None:
            return
        s.accepted = True
        if s.waiting_since_s is not None:
            now = self.clock()
            observed = [(name, now - s.waiting_since_s) for name in s.waiting_tools]
            for name, waited in observed:
                self._estimate(name).observed.append(waited)
            s.resumed = _Wait(s.waiting_since_s, list(s.waiting_tools), s.waiting_ids, s.waiting_hashes,
                              s.waiting_expected_s, observed)
            self.resumes.begin(session_id, s.waiting_ids)
            s.waiting_ids = None
            self._end_wait(session_id, s)
        self.resumes.accepted(session_id, s.encoder.ids if prompt_ids is None else prompt_ids)

    def turn_ended(self, session_id: str | None, token_ids, tool_names: list[str], hint_s: float | None,
                   final=None, block_hashes: list[bytes] | None = None) -> None:
        """A turn of ``session_id`` finished; ``tool_names`` non-empty: it ended in tool calls and
        the session now waits on them (``token_ids``: its prompt and output). ``final``: how it
        ended (None: aborted), for the resume target. ``block_hashes``: the chained hashes of the
        first full pages of ``token_ids`` already known (the request's ``Sequence.block_hashes``,
        with the engine's salt and this session's ``cache_salt``); only the pages past them are
        hashed for the tool wait."""
        self.resumes.end(session_id, final)
        s = self.sessions.get(session_id) if session_id is not None else None
        if s is None:
            return
        s.in_flight = max(s.in_flight - 1, 0)
        s.last_used_s = self.clock()
        s.resumed = None
        if not tool_names:
            return
        expected = hint_s if hint_s is not None else max(self._estimate(n).value() for n in tool_names)
        hashes = self._chain(token_ids, s.cache_salt, block_hashes or [])
        self.engine.pool.tool_wait_blocks(session_id, hashes, expected)
        s.waiting_since_s, s.waiting_tools = s.last_used_s, list(tool_names)
        s.waiting_ids, s.waiting_hashes, s.waiting_expected_s = list(token_ids), hashes, expected

    def generated(self, session_id: str | None, final, encoder=None, messages=None, cache_salt: str = "") -> bool:
        """A chat turn of ``session_id`` ended with ``final`` (a :class:`kvtier.serve.api.jobs.Final`):
        its session's encoder keeps the ids it sampled for the assistant message returned
        (``append_generated``). With no session id, ``encoder`` (the request's, from
        :meth:`encoder`) keeps them and is filed under ``messages`` and that message for a later
        request with no id to find; it is filed as well when the turn's ids are not kept (a
        length stop, a stop string), for the prompt's ids it holds. Call before :meth:`turn_ended`.
        Nothing is kept for a turn that failed, that a stop string cut, that did not end its
        message (``append_generated``), or while another request of the session is in flight.

        Returns:
            whether the ids were kept.
        """
        if final.error is not None or not final.token_ids:
            return False
        if session_id is not None:
            s = self.sessions.get(session_id)
            if s is None or s.in_flight != 1:
                return False
            encoder = s.encoder
        if encoder is None:
            return False
        message = {"role": "assistant", "content": final.content, "reasoning_content": final.reasoning,
                   "tool_calls": [{"id": c.get("id"), "type": "function",
                                   "function": {"name": c["name"], "arguments": c["arguments"]}}
                                  for c in final.tool_calls]}
        kept = False
        if final.stop_sequence is None:
            try:
                kept = encoder.append_generated(final.token_ids, message)
            except ValueError:  # an encoder that does not end with a generation prompt
                return False
        if session_id is None and messages is not None:
            key = _content_keys(list(messages) + [message], cache_salt)[-1]
            self.by_content[key] = (encoder, self.clock())
            self.by_content.move_to_end(key)
        self._evict()
        return bool(kept)

    def _take_by_content(self, messages, cache_salt: str):
        if not self.by_content or not isinstance(messages, list):
            return None
        for key in reversed(_content_keys(messages, cache_salt)):
            found = self.by_content.pop(key, None)
            if found is not None:
                return found[0]
        return None

    def _evict(self) -> None:
        """Evict least recently used idle sessions (and encoders filed by content) while the
        store holds more than ``max_tokens`` ids."""
        held = sum(len(s.encoder) for s in self.sessions.values()) + sum(len(e) for e, _ in self.by_content.values())
        if held <= self.max_tokens:
            return
        idle = [(s.last_used_s, 0, sid, len(s.encoder)) for sid, s in self.sessions.items() if not s.in_flight]
        idle += [(t, 1, key, len(e)) for key, (e, t) in self.by_content.items()]
        for _, kind, key, n in sorted(idle, key=lambda x: (x[0], x[1])):
            if held <= self.max_tokens:
                break
            if kind == 0:
                self.end(key)
            else:
                del self.by_content[key]
            held -= n
            self.num_evicted += 1

    def aborted(self, session_id: str | None) -> None:
        """A request of ``session_id`` the engine accepted was aborted before it finished (its
        client disconnected, or the engine failed). If it was a resume, the session waits on its
        tools again as if that request had never come: the pool is told again (the time left of
        the expected wait), the wait it observed is taken back from the tools' estimates, and the
        client's retry is the resume the target counts."""
        s = self.sessions.get(session_id) if session_id is not None else None
        w = s.resumed if s is not None else None
        self.turn_ended(session_id, None, [], None)
        if w is None or s.waiting_since_s is not None:
            return
        for name, waited in w.observed:
            observed = self._estimate(name).observed
            if waited in observed:
                observed.remove(waited)
        left = max(w.expected_s - (self.clock() - w.since_s), 0.0)
        self.engine.pool.tool_wait_blocks(session_id, w.hashes, left)
        s.waiting_since_s, s.waiting_tools = w.since_s, w.tools
        s.waiting_ids, s.waiting_hashes, s.waiting_expected_s = w.ids, w.hashes, w.expected_s

    def _chain(self, token_ids, cache_salt: str, known: list[bytes]) -> list[bytes]:
        """The hashes of every full page of ``token_ids``: ``known``'s first ones, the rest hashed."""
        ps = self.engine.config.pool.page_size
        n = len(token_ids) // ps
        known = known[:n]
        k = len(known)
        if k == n:
            return list(known)
        salt = self.engine.block_hash_salt + request_salt(cache_salt)
        return list(known) + block_hashes(token_ids[k * ps:n * ps], ps, known[-1] if k else None, salt)

    @property
    def num_waiting(self) -> int:
        """Sessions waiting on a tool now."""
        return sum(s.waiting_since_s is not None for s in self.sessions.values())

    def end(self, session_id: str) -> bool:
        """Drop a session (its encoder; its tool wait ends). False if there was none."""
        s = self.sessions.pop(session_id, None)
        self.resumes.end(session_id, None)
        if s is None:
            return False
        self._end_wait(session_id, s)
        return True

    def expire(self) -> int:
        """Drop sessions idle longer than ``ttl_s``; returns how many."""
        now = self.clock()
        old = [sid for sid, s in self.sessions.items() if not s.in_flight and now - s.last_used_s > self.ttl_s]
        for sid in old:
            self.end(sid)
        stale = [key for key, (_, t) in self.by_content.items() if now - t > self.ttl_s]
        for key in stale:
            del self.by_content[key]
        self.num_expired += len(old) + len(stale)
        return len(old) + len(stale)

    def _estimate(self, tool: str) -> ToolWaitEstimate:
        est = self.tool_waits.get(tool)
        if est is None:
            est = self.tool_waits[tool] = ToolWaitEstimate(DEFAULT_TOOL_WAIT_S)
        return est

    def _end_wait(self, session_id: str, s: Session) -> None:
        if s.waiting_since_s is not None:
            self.engine.pool.tool_return(session_id)
        s.waiting_since_s, s.waiting_tools = None, []


def _content_keys(messages: list, cache_salt: str) -> list[bytes]:
    """For each assistant message of ``messages``, the chained digest of the conversation up to
    it (``cache_salt`` first; an assistant message by :func:`kvtier.tokenize.sampled.message_key`,
    any other as sorted JSON)."""
    h = hashlib.sha256(cache_salt.encode())
    out = []
    for m in messages:
        key = message_key(m)
        item = json.dumps(key if key is not None else m, sort_keys=True, ensure_ascii=False, default=repr)
        h.update(len(item).to_bytes(8, "little") + item.encode())
        if key is not None:
            out.append(h.copy().digest())
    return out
