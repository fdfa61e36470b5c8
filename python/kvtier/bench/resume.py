"""Resume-target misses of a replay, counted from its records (in process or simulated).

A *resume* is a turn after a turn that stopped on ``tool_use``; it misses the target when its
TTFT is over it, classified as the server classifies its own resumes
(:func:`kvtier.serve.api.resume.miss_reason`: ``evicted``, ``prefetch_late``, ``queued``,
``prefill``) from
the whole pages it shares with the previous turn's prompt. ``kvtier bench --endpoint`` reads the
server's counters instead (:func:`kvtier.bench.endpoint.resume_slo_delta`).
"""

from __future__ import annotations

from kvtier.serve.api.resume import REASONS, findable_tokens, miss_reason

__all__ = ["resume_misses"]


def resume_misses(workload, records, target_s: float, page_size: int | None = None, prefill_s=None) -> dict:
    """Resumes of ``records`` and their misses of ``target_s`` by reason.

    Args:
        workload: the replayed :class:`~kvtier.bench.workload.Workload` (its turns' ``stop`` and
            ``block_ids``).
        records: the run's :class:`~kvtier.bench.records.RequestRecord` list; failed turns are
            left out.
        target_s: the resume target, seconds (> 0).
        page_size: the engine's tokens per page, a multiple of the workload's block size (None:
            the block size); a hit is counted in whole pages, so only whole shared pages are
            findable.
        prefill_s: ``prefill_s(new_tokens, cached_tokens)``, estimated seconds of a step that
            prefills only a resume's tokens past those it can find (the ``prefill`` reason); None:
            not counted.

    Returns:
        ``{"resumes": n, "misses": {reason: n}, "ttft_s": [...], "found": [(where, ttft_s)]}``;
        ``where`` is where the shared prefix was found: ``device`` (all of it), ``lower`` (some in
        a tier below), ``evicted`` (not all of it anywhere).

    Raises:
        ValueError: ``target_s`` not > 0, or a ``page_size`` that is not a multiple of the block size.
    """
    if not target_s > 0:
        raise ValueError(f"target_s must be > 0 seconds, got {target_s!r}")
    bs = workload.block_size
    page = bs if page_size is None else page_size
    if page < 1 or page % bs:
        raise ValueError(f"page_size must be a multiple of the workload's block size {bs}, got {page_size!r}")
    by_turn = {(r.session_id, r.turn): r for r in records}
    out = {"resumes": 0, "misses": dict.fromkeys(REASONS, 0), "ttft_s": [], "found": []}
    for s in workload.sessions:
        for k in range(1, len(s.turns)):
            prev, turn, r = s.turns[k - 1], s.turns[k], by_turn.get((s.session_id, k))
            if prev.stop != "tool_use" or r is None or r.error is not None:
                continue
            shared = 0
            for a, b in zip(prev.block_ids[:prev.input_tokens // bs], turn.block_ids):
                if a != b:
                    break
                shared += 1
            kept = shared * bs // page * page
            out["resumes"] += 1
            out["ttft_s"].append(r.ttft_s)
            findable = findable_tokens(kept, r.input_tokens, page)
            found = "evicted" if r.cached_tokens < findable else \
                "device" if r.cached_tokens_by_tier.get("device", 0) >= findable else "lower"
            out["found"].append((found, r.ttft_s))
            why = miss_reason(r.ttft_s, target_s, kept, r.input_tokens, r.cached_tokens, r.cached_tokens_by_tier, page,
                              prefill_s)
            if why is not None:
                out["misses"][why] += 1
    return out
