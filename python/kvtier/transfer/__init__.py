"""Copy engine facade: asynchronous, batched block copies between tiers (GIL released)."""

from kvtier.transfer.copy_engine import CopyEngine, CopyError, CopyHandle, PagePoolView

__all__ = ["CopyEngine", "CopyError", "CopyHandle", "PagePoolView"]
