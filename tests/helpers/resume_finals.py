"""A request's final record with chosen timing and cached tokens, for resume-tracking tests."""

from __future__ import annotations

from kvtier.serve.api.jobs import Final


def _final(ttft_s=2.0, prompt=100, cached=64, tiers=None, error=None) -> Final:
    return Final("stop", prompt, 4, cached, tiers if tiers is not None else {"device": cached}, "", "", [], [], None,
                 [], ttft_s=ttft_s, error=error)
