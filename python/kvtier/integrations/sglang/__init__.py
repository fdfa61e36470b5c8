"""kvtier's tiers inside SGLang: a HiCache storage backend (docs/sglang.md).

:class:`KvtierStorage` (in :mod:`kvtier.integrations.sglang.storage`, which imports SGLang) is
what ``--hicache-storage-backend dynamic`` loads with ``"module_path":
"kvtier.integrations.sglang", "class_name": "KvtierStorage"``. The settings
(:mod:`~kvtier.integrations.sglang.config`), the tiers of one pool
(:mod:`~kvtier.integrations.sglang.page_store`) and the hit rule
(:mod:`~kvtier.integrations.sglang.hit_rules`) import without SGLang.
"""

__all__ = ["KvtierStorage"]


def __getattr__(name: str):
    if name == "KvtierStorage":
        from kvtier.integrations.sglang.storage import KvtierStorage
        return KvtierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
