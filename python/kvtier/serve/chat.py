"""The chat path shared by :meth:`kvtier.LLM.chat` and ``kvtier serve``: tools merged into the
sampling parameters, the conversation encoded by a session's incremental encoder, the request
queued with the encoder's token buffer (whose block hashes, computed once as ids are appended,
the engine and the pool read instead of hashing the prompt again)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import numpy as np

from kvtier.serve.engine import Engine
from kvtier.serve.intake import request_salt
from kvtier.serve.params import SamplingParams


def chat_sampling_params(params: SamplingParams | None, tools: Seq[dict] | None = None,
                         tool_choice=None) -> SamplingParams:
    """``params`` with ``tools`` (when it names none) and ``tool_choice`` (when given) set.

    Raises:
        ValueError: ``params`` is not a SamplingParams, ``tools`` differs from ``params.tools``, or bad tools / ``tool_choice``
        (naming ``tools[i]...`` or ``tool_choice``).
    """
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams or None, got {type(params).__name__}")
    changes = {}
    if tools and params.tools is None:
        changes["tools"] = list(tools)
    elif tools and list(tools) != list(params.tools):
        raise ValueError("tools differs from sampling_params.tools: the prompt would declare other tools than "
                         "the grammar allows; give them once")
    if tool_choice is not None:
        changes["tool_choice"] = tool_choice
    return dataclasses.replace(params, **changes) if changes else params


def check_tool_results(messages: Seq[dict]) -> None:
    """Each ``tool`` message answers a call of an earlier assistant message, as OpenAI's chat API
    requires (it refuses a ``tool_call_id`` found in no earlier ``tool_calls``); a result of no
    call would otherwise be rendered, and counted as a session's resume after a tool wait.

    Raises:
        ValueError: naming ``messages[i].tool_call_id`` when it matches no earlier call.
    """
    if not isinstance(messages, Seq) or isinstance(messages, (str, bytes)):
        return  # the renderer names what is wrong with it
    calls: set = set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls.update(c.get("id") for c in m["tool_calls"] if isinstance(c, dict))
        elif m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if isinstance(call_id, str) and call_id not in calls:
                raise ValueError(f"messages[{i}].tool_call_id: {call_id!r} matches no tool call of an earlier "
                                 "assistant message (each tool message answers one of its tool_calls[].id)")


def new_encoder(engine: Engine, tokenizer, cache_salt: str = ""):
    """A :class:`kvtier.tokenize.SessionEncoder` whose token buffer hashes pages as ``engine`` does
    for requests with ``cache_salt``."""
    from kvtier.tokenize import SessionEncoder

    return SessionEncoder(tokenizer, page_size=engine.config.pool.page_size,
                          salt=engine.block_hash_salt + request_salt(cache_salt))


def add_chat_request(engine: Engine, encoder, messages: Seq[dict], params: SamplingParams,
                     cache_salt: str = "", tool_matcher=None) -> int:
    """Encode ``messages`` (the whole conversation) with ``encoder`` and queue the turn; returns
    the request id. The prompt declares ``params.tools`` (the tools the grammar allows);
    ``encoder`` must come from :func:`new_encoder` with the same ``cache_salt``; ``tool_matcher``:
    see :meth:`Engine.add_request`.

    Raises:
        ValueError: no messages, bad messages or tools (naming ``messages[i].field`` /
        ``tools[i]...``), or a prompt the engine refuses (see :meth:`Engine.check_request`).
    """
    if isinstance(messages, Seq) and not isinstance(messages, (str, bytes)) and not messages:
        raise ValueError("messages: empty; a conversation needs at least one message")
    check_tool_results(messages)
    encoder.append(messages, params.tools)
    # The encoder's token buffer hashed each page once as it was appended: the engine reads them
    # from it (no hashing again), and the pool hashes only the pages past them.
    buf = encoder.token_buffer
    hashes = buf if buf is not None else encoder.block_hashes()
    return engine.add_request(np.asarray(encoder.ids), params, prompt_block_hashes=hashes,
                              cache_salt=cache_salt, tool_matcher=tool_matcher)
