"""Engines on adversarial pages: a NaN-filled page pool and a shuffled free-page order."""

from __future__ import annotations

import random
from collections import OrderedDict

from kvtier import LLM


PAGE_SIZE = 16


def poisoned_llm(path, seed=0, **engine_args) -> LLM:
    llm = LLM(str(path), dtype="float32", page_size=PAGE_SIZE, num_device_pages=96, **engine_args)
    for cache in llm.engine.runner.kv_caches:
        cache.fill_(float("nan"))
    pages = llm.engine.pool.pages  # the pool's page accounting: shuffle its reuse order
    order = list(pages.free_pages)
    random.Random(seed).shuffle(order)
    pages.free_pages = OrderedDict((p, None) for p in order)
    return llm
