"""vLLM's prefill rate as the connector's scheduler side learns it: a probe at start, then the steps.

The load-or-recompute choice needs what recomputing a run of blocks costs in *this* vLLM on
*this* machine. :func:`probe_prefill_tok_s` gives a first figure before any request ran: the
machine's matrix-multiply rate (measured) over the model's multiply-adds per token (from its
config). :class:`PrefillRate` then times every step between the scheduler's
``build_connector_meta`` and the ``update_connector_output`` that follows it (vLLM calls the
latter after every step that ran a forward pass; a step with no work is not timed) and fits it with kvtier's own step-time
model (:class:`kvtier.serve.step_time.StepTimeModel`, the fit kvtier's scheduler uses:
``seconds = w . (1, prefill tokens, prefill query-key pairs, decodes, decode context)``); until
that fit exists, an average of prefill tokens per second over the prefill steps seen.

(``integrations/`` sits above ``serve/`` and ``cache/``: importing the serve layer's fit is a
downward import.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.serve.step_plan import pairs
from kvtier.serve.step_time import StepTimeModel, step_features

PROBE_TOKENS = 256
"""Rows of the probe's matrix multiply (a prefill chunk's worth of tokens)."""


def macs_per_token(hf_config) -> float:
    """Multiply-adds one prefill token costs in a decoder's linear layers (attention projections and
    MLP; the attention scores grow with the context and are left to the fitted model).

    Args:
        hf_config: a Hugging Face config with ``hidden_size``, ``num_hidden_layers``,
            ``intermediate_size`` and optionally ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``.

    Raises:
        ValueError: a config without ``hidden_size`` / ``num_hidden_layers`` / ``intermediate_size``.
    """
    try:
        hidden, layers, inter = hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.intermediate_size
    except AttributeError as e:
        raise ValueError(f"hf_config must have hidden_size, num_hidden_layers and intermediate_size: {e}") from None
    heads = getattr(hf_config, "num_attention_heads", None) or 1
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return float(layers * (attn + 3 * hidden * inter))


def probe_prefill_tok_s(hf_config, dtype: torch.dtype = torch.float32, repeats: int = 3) -> float:
    """Prefill tokens per second this machine should manage for the model of ``hf_config``: the
    measured rate of one ``[PROBE_TOKENS, hidden] @ [hidden, intermediate]`` multiply in ``dtype``
    (best of ``repeats``) over :func:`macs_per_token`. A first estimate (it ignores attention
    scores and vLLM's overheads), replaced by :class:`PrefillRate`'s fit of measured steps."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    a = torch.randn(PROBE_TOKENS, hidden).to(dtype)
    b = torch.randn(hidden, inter).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms the kernels up
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    macs_s = PROBE_TOKENS * hidden * inter / max(best, 1e-9)
    return macs_s / macs_per_token(hf_config)


class PrefillRate:
    """The cost of recomputing tokens in vLLM, learned from the steps the scheduler sees.

    Args:
        tok_s: the starting rate (tokens/s, > 0): a probe's (:func:`probe_prefill_tok_s`) or a
            configured one.
        learn: fold measured steps in; False keeps ``tok_s`` (a configured ``prefill_tok_s``).
        clock: seconds (monotonic).

    Raises:
        ValueError: ``tok_s`` <= 0.
    """

    def __init__(self, tok_s: float, learn: bool = True, clock: Callable[[], float] = time.perf_counter):
        if not tok_s > 0:
            raise ValueError(f"tok_s must be > 0, got {tok_s}")
        self.tok_s, self.learn, self.clock = float(tok_s), learn, clock
        self.model = StepTimeModel()
        self._started: tuple[np.ndarray, float] | None = None
        self.steps_seen = 0

    def step_started(self, extends: Sequence[tuple[int, int]], num_decodes: int, decode_context: int) -> None:
        """A step was scheduled: ``extends`` its prefill chunks as ``(new_tokens, cached_tokens)``,
        ``num_decodes`` decoding requests attending ``decode_context`` tokens in all."""
        work = bool(extends) or num_decodes > 0
        self._started = (step_features(extends, num_decodes, decode_context), self.clock()) if work else None

    def step_ended(self) -> None:
        """The last started step's output came back: fold its time in (nothing if that step had
        no work or was folded in already)."""
        if self._started is None:
            return
        (features, t0), self._started = self._started, None
        seconds = self.clock() - t0
        if not self.learn or not seconds > 0:
            return
        self.steps_seen += 1
        self.model.observe(features, seconds)
        if features[1] > 0:  # before the fit: prefill tokens per second of the prefill steps
            self.tok_s += 0.25 * (features[1] / seconds - self.tok_s)

    def recompute_s(self, cached_tokens: int, num_tokens: int) -> float:
        """Seconds vLLM takes to prefill ``num_tokens`` after ``cached_tokens`` of context."""
        w = self.model.weights if self.learn else None
        if w is None or w[1] <= 0:
            return num_tokens / self.tok_s
        return float(w[1] * num_tokens + w[2] * pairs(cached_tokens, num_tokens))

    def rate(self, cached_tokens: int, num_tokens: int) -> float:
        """The prefill rate (tokens/s) of that run: what the cost model's ``prefill_tok_s`` is set
        to before it chooses how much of the run to load."""
        if num_tokens <= 0:
            return self.tok_s
        return num_tokens / max(self.recompute_s(cached_tokens, num_tokens), 1e-12)
