"""What a request gives back: its stop rules, its tool-call parser's events and its
:class:`~kvtier.serve.params.RequestOutput`."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.serve.params import RequestOutput
from kvtier.serve.request import Sequence


def append_token(seq: Sequence, token: int, clock: Callable[[], float], model_config) -> str | None:
    """Append ``token`` to ``seq``'s output (its first token time, and its finish time when it
    stops, read from ``clock``); returns :func:`stop_reason`."""
    seq.output_token_ids.append(token)
    now = clock()
    if seq.metrics.first_token_time is None:
        seq.metrics.first_token_time = now
    reason = stop_reason(seq, model_config)
    if reason is not None:
        seq.metrics.finish_time = now
    return reason


def stop_reason(seq: Sequence, model_config) -> str | None:
    """Why ``seq`` stops after the token it just appended: ``"stop"`` (its grammar finished the
    turn, or an end-of-sequence token unless ``ignore_eos``), ``"length"`` (``max_tokens`` or the
    context is reached, or the budget forced the end of turn where the text stood:
    ``ToolCallConstraint.cut_by_budget``), or None: it goes on."""
    token = seq.output_token_ids[-1]
    if seq.constraint is not None and seq.constraint.finished:
        return "length" if seq.constraint.cut_by_budget else "stop"
    if token in model_config.eos_token_id and not seq.params.ignore_eos:
        return "stop"
    if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= model_config.max_position_embeddings:
        return "length"
    return None


def parse(seq: Sequence, final: bool = False) -> list:
    """Feed ``seq``'s output tokens not yet parsed to its parser (then end it when ``final``);
    returns the new events ([] without a parser): :class:`kvtier.toolcall.ContentDelta`,
    ``ReasoningDelta``, ``ToolCall`` (each as soon as its ``<|tool_call_end|>`` is seen) and
    ``ToolCallProblem``, in output order.

    The request's one parser is fed here, by a streaming consumer after each step
    (``Engine.take_events``) and at the end by :func:`request_output`, whose
    ``RequestOutput.events`` holds the events not taken yet, ending with the parser's
    ``finish``; how the output is cut into calls never changes ``content``, ``tool_calls`` and
    the other parsed fields."""
    if seq.parser is None:
        return []
    new = seq.output_token_ids[seq.num_parsed_tokens:]
    seq.num_parsed_tokens += len(new)
    events = seq.parser.feed_ids(new)
    return events + seq.parser.finish() if final else events


def request_output(seq: Sequence, num_steps: int, page_size: int) -> RequestOutput:
    """``seq``'s output, its parser ended (the events not taken yet), ``finish_step`` set to
    ``num_steps`` when not set yet."""
    if seq.metrics.finish_step is None:
        seq.metrics.finish_step = num_steps
    parsed = {}
    if seq.parser is not None:  # the tokens take_events has not parsed yet, then the end
        events = parse(seq, final=True)
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
        last_prompt_block=_last_prompt_block(seq, page_size),
        **parsed,
    )


def _last_prompt_block(seq: Sequence, page_size: int) -> bytes | None:
    full = seq.num_prompt_tokens // page_size
    return seq.block_hashes[full - 1] if 0 < full <= len(seq.block_hashes) else None


__all__ = ["append_token", "parse", "request_output", "stop_reason"]
