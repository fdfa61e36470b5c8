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
                         tool_choice=None, response_format=None) -> SamplingParams:
    """``params`` with ``tools`` (when it names none), ``tool_choice`` and ``response_format``
    (when given: the answer is decoded under its JSON schema) set.

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
    if response_format is not None:
        changes["response_format"] = response_format
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
    """A session encoder for ``tokenizer``'s chat format (:func:`kvtier.tokenize.xtml_session.session_encoder`:
    K2's template or K3's XTML) whose token buffer hashes pages as ``engine`` does for requests
    with ``cache_salt``; it keeps a turn's sampled ids when told them (``append_generated``)."""
    from kvtier.tokenize.xtml_session import session_encoder

    return session_encoder(tokenizer, page_size=engine.config.pool.page_size,
                           salt=engine.block_hash_salt + request_salt(cache_salt), keep_sampled=True)


def chat_prompt_options(chat_format, params: SamplingParams, *, tools: Seq[dict] | None = None, tool_choice=None,
                        thinking=None, reasoning_effort=None, response_format=None):
    """The request fields that shape a K3 prompt, checked as K3's API checks them.

    Args:
        chat_format: the model's :class:`kvtier.tokenize.ChatFormat` (``tokenizer.chat_format``).
        params: the request's sampling parameters (their ``tools`` and ``tool_choice`` are the
            request's, after :func:`chat_sampling_params`).
        tools: the request's ``tools`` as sent (an empty list is refused; None: none sent).
        tool_choice: the request's ``tool_choice`` in chat's shape as sent (K3 renders the tail of
            ``none`` even without tools); None: ``params.tool_choice`` when it has tools.
        thinking: None (on) or K3's ``{"type": "enabled" | "disabled", "effort"?: str, "keep"?:
            "all"}``; Anthropic's ``budget_tokens`` is accepted beside ``type`` and not used.
        reasoning_effort: None or ``low`` / ``high`` / ``max`` (the same as ``thinking.effort``).
        response_format: None or a shape of :func:`kvtier.tokenize.xtml.check_response_format`.

    Returns:
        a :class:`kvtier.tokenize.xtml.XtmlOptions` for a K3 model; None for K2's template, whose
        prompt takes none of these fields.

    Raises:
        ValueError: naming the field (``thinking``, ``thinking.type``, ``thinking.effort``,
            ``thinking.keep``, ``reasoning_effort``, ``tools``, ``tool_choice``,
            ``response_format...``) and what K3 accepts.
    """
    from kvtier.tokenize import ChatFormat
    from kvtier.tokenize.xtml import THINKING_EFFORTS, XtmlOptions

    if chat_format is not ChatFormat.K3_XTML:
        return None
    if tools is not None and not tools:
        raise ValueError("tools: an empty list; send at least one tool or leave tools out")
    on, effort = _thinking(thinking)
    if reasoning_effort is not None:
        if reasoning_effort not in THINKING_EFFORTS:
            raise ValueError(f"reasoning_effort: expected one of {list(THINKING_EFFORTS)}, got "
                             f"{reasoning_effort!r:.60}")
        if not on:
            raise ValueError("reasoning_effort: needs thinking (thinking.type is 'disabled')")
        if effort is not None and effort != reasoning_effort:
            raise ValueError(f"reasoning_effort: {reasoning_effort!r} differs from thinking.effort {effort!r}; "
                             "give one")
        effort = reasoning_effort
    choice = tool_choice if tool_choice is not None else (params.tool_choice if params.tools else None)
    return XtmlOptions(thinking=on, thinking_effort=effort, tool_choice=choice, response_format=response_format)


def _thinking(thinking) -> tuple[bool, str | None]:
    """(thinking on, effort) of K3's ``thinking`` field (see :func:`chat_prompt_options`)."""
    from kvtier.tokenize.xtml import THINKING_EFFORTS

    if thinking is None:
        return True, None
    if not isinstance(thinking, dict):
        raise ValueError(f"thinking: expected an object {{'type': 'enabled' | 'disabled', ...}}, got "
                         f"{type(thinking).__name__}")
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled"):
        raise ValueError(f"thinking.type: expected 'enabled' or 'disabled', got {kind!r:.60}")
    effort = thinking.get("effort")
    if effort is not None and effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking.effort: expected one of {list(THINKING_EFFORTS)}, got {effort!r:.60}")
    if effort is not None and kind == "disabled":
        raise ValueError("thinking.effort: only with thinking.type 'enabled'")
    keep = thinking.get("keep")
    if keep is not None and keep != "all":
        raise ValueError(f"thinking.keep: K3 keeps every history turn's reasoning (preserved thinking): only 'all' is "
                         f"supported, got {keep!r:.60}")
    budget = thinking.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValueError(f"thinking.budget_tokens: expected a positive integer, got {budget!r:.60}")
    return kind == "enabled", effort


def add_chat_request(engine: Engine, encoder, messages: Seq[dict], params: SamplingParams,
                     cache_salt: str = "", tool_matcher=None, prompt_options=None) -> int:
    """Encode ``messages`` (the whole conversation) with ``encoder`` and queue the turn; returns
    the request id. The prompt declares ``params.tools`` (the tools the grammar allows);
    ``encoder`` must come from :func:`new_encoder` with the same ``cache_salt``; ``tool_matcher``:
    see :meth:`Engine.add_request`. ``prompt_options``: a K3 prompt's
    :class:`kvtier.tokenize.xtml.XtmlOptions` (:func:`chat_prompt_options`; None: the defaults);
    must be None for K2's template.

    Raises:
        ValueError: no messages, bad messages or tools (naming ``messages[i].field`` /
        ``tools[i]...``), or a prompt the engine refuses (see :meth:`Engine.check_request`).
    """
    from kvtier.tokenize.xtml_session import XtmlSessionEncoder

    if isinstance(messages, Seq) and not isinstance(messages, (str, bytes)) and not messages:
        raise ValueError("messages: empty; a conversation needs at least one message")
    check_tool_results(messages)
    if isinstance(encoder, XtmlSessionEncoder):
        encoder.append(messages, params.tools, prompt_options)
    elif prompt_options is not None:
        raise ValueError("prompt_options: K3's prompt fields, for a model that speaks K3's format (this one speaks "
                         "K2's template)")
    else:
        encoder.append(messages, params.tools)
    # The encoder's token buffer hashed each page once as it was appended: the engine reads them
    # from it (no hashing again), and the pool hashes only the pages past them.
    buf = encoder.token_buffer
    hashes = buf if buf is not None else encoder.block_hashes()
    # a hybrid model keeps its state where the next turns come back: the renderer says where
    return engine.add_request(np.asarray(encoder.ids), params, prompt_block_hashes=hashes,
                              cache_salt=cache_salt, tool_matcher=tool_matcher,
                              checkpoint_at=tuple(encoder.boundaries().values()))
