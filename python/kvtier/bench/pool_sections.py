"""The hybrid model's part of a ``kvtier bench`` report: the recurrent-state checkpoint counters of
a run as JSON (:func:`state_json`) and as table rows (:func:`state_rows`)."""

from __future__ import annotations

from dataclasses import asdict


def state_json(run) -> dict | None:
    """The recurrent-state checkpoint counters of ``run`` (a :class:`kvtier.bench.records.ConfigRun`)
    as JSON, None when it has none: every :class:`kvtier.cache.pool_stats.StateStats` field
    (``hits`` by tier, ``bytes_loaded`` and ``bytes_written`` in bytes by tier, ``saved`` by
    kind, ``evictions``, ``refused``, ``failures`` by reason, ``fallbacks``, ``tokens_lost`` in
    tokens), plus ``hits_total``, ``bytes_loaded_total`` and ``bytes_written_total`` (bytes
    written below the device: host, disk and remote; a device write copies within the device)."""
    st = run.state if run.server_counters else None
    if st is None:
        return None
    out = asdict(st)
    out["hits_total"] = sum(st.hits.values())
    out["bytes_loaded_total"] = sum(st.bytes_loaded.values())
    out["bytes_written_total"] = sum(n for t, n in st.bytes_written.items() if t != "device")
    return out


def state_rows(s: dict[str, dict], names: list[str], tiers, fmt_bytes) -> list[tuple[str, list[str]]]:
    """The checkpoint rows of a hybrid model's runs (none when no run has ``state``): hits per
    tier, bytes loaded from and written to each tier below the device, fallbacks and tokens lost.
    ``s``: each run's :func:`kvtier.bench.report.summarize` by name; ``tiers``: the local tier
    names; ``fmt_bytes``: how a byte count is printed. The remote tier shows only when some run
    used it."""
    states = [s[n]["state"] for n in names if s[n]["state"] is not None]
    if not states:
        return []
    shown = [*tiers, *(["remote"] if any(st["hits"].get("remote") or st["bytes_written"].get("remote")
                                         for st in states) else [])]

    def col(cell) -> list[str]:
        return ["n/a" if s[n]["state"] is None else cell(s[n]["state"]) for n in names]

    rows = [(f"checkpoint hits {t}", col(lambda x, t=t: str(x["hits"].get(t, 0)))) for t in shown]
    rows += [(f"state bytes {t}->device", col(lambda x, t=t: fmt_bytes(x["bytes_loaded"].get(t, 0))))
             for t in shown if t != "device"]
    rows += [(f"state bytes ->{t}", col(lambda x, t=t: fmt_bytes(x["bytes_written"].get(t, 0))))
             for t in shown if t != "device"]
    rows.append(("checkpoints saved grid / turn", col(lambda x: f"{x['saved'].get('grid', 0)} / "
                                                                f"{x['saved'].get('turn', 0)}")))
    rows.append(("checkpoint fallbacks", col(lambda x: str(x["fallbacks"]))))
    rows.append(("prefix tokens lost (no checkpoint)", col(lambda x: str(x["tokens_lost"]))))
    return rows
