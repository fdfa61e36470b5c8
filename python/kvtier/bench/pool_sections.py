"""The pool's counter sections in a ``kvtier bench`` report, whatever they are: each section
(:attr:`kvtier.cache.pool_stats.PoolSnapshot.sections`) as JSON (:func:`sections_json`), as
table rows (:func:`section_rows`) and as the figures ``--repeat`` summarizes
(:func:`section_figures`), read from the fields the section declares
(:func:`kvtier.cache.pool_stats.series_table`). A new section shows up with no change here."""

from __future__ import annotations

from dataclasses import asdict

from kvtier.cache.pool_stats import series_table


def _total(field: str, counts: dict[str, int]) -> int:
    """A dict count's total; a byte count's leaves out ``device`` (a device write copies within
    the device: no bytes cross a link)."""
    return sum(n for k, n in counts.items() if not (field.startswith("bytes_") and k == "device"))


def sections_json(run) -> dict[str, dict]:
    """``{section name: counters}`` of ``run`` (a :class:`kvtier.bench.records.ConfigRun`), empty
    when the engine's counters were not observed (over HTTP) or its pools keep none. Each section
    is its fields (an int, or a dict of ints by tier, kind or reason; ``bytes_*`` in bytes) plus
    ``<field>_total`` of each dict field (for ``bytes_*``, the bytes that crossed below the device:
    the ``device`` entry left out)."""
    if not run.server_counters:
        return {}
    out = {}
    for name, section in run.sections.items():
        doc = asdict(section)
        doc |= {f"{f}_total": _total(f, v) for f, v in doc.items() if isinstance(v, dict)}
        out[name] = doc
    return out


def section_rows(runs, s: dict[str, dict], fmt_bytes) -> list[tuple[str, list[str]]]:
    """The table rows of each section any of ``runs`` has: ``"<section> <field>"`` for a plain
    count, ``"<section> <field> <key>"`` for each key of a dict field that some run counted (a
    key at 0 in every run is left out); ``n/a`` for a run without the section. ``s``: each run's
    :func:`kvtier.bench.report.summarize` by name; ``fmt_bytes``: how a ``bytes_*`` count is printed."""
    names = [r.name for r in runs]
    kinds = {n: type(sec) for r in runs for n, sec in r.sections.items()}
    rows = []
    for sec, kind in kinds.items():
        got = {n: s[n]["sections"].get(sec) for n in names}
        for field, (_, _, label) in series_table(kind).items():
            show = fmt_bytes if field.startswith("bytes_") else str
            cells = {f"{sec} {field}": lambda g, field=field: g[field]} if label is None else {
                f"{sec} {field} {k}": lambda g, field=field, k=k: g[field].get(k, 0)
                for k in dict.fromkeys(k for g in got.values() if g is not None for k, v in g[field].items() if v)}
            rows += [(row, ["n/a" if got[n] is None else show(cell(got[n])) for n in names])
                     for row, cell in cells.items()]
    return rows


def section_figures(summaries) -> list[str]:
    """The figures ``kvtier bench --repeat`` summarizes of the sections in ``summaries`` (each a
    :func:`kvtier.bench.report.summarize` dict), as dotted paths: every int of each section (its
    plain counts and its dict fields' totals)."""
    return list(dict.fromkeys(f"sections.{sec}.{field}" for summary in summaries
                              for sec, doc in summary.get("sections", {}).items()
                              for field, v in doc.items() if isinstance(v, int)))


def figure_label(path: str) -> tuple[str, float, str]:
    """``(label, scale, format)`` of a :func:`section_figures` path; a ``bytes_*`` count in MiB."""
    _, sec, field = path.split(".")
    if field.startswith("bytes_"):
        return f"{sec} {field} (MiB)", 1 / 2**20, "{:.1f}"
    return f"{sec} {field}", 1.0, "{:.0f}"
