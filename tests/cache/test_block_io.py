"""The pool's block verbs for another worker: held prefix, export of device copies, import of
payloads as cached device copies (what prefill/decode transfer uses instead of pool internals)."""

import torch

from kvtier.cache.config import PoolConfig
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier

PS, PAGES = 4, 6


def _pool(seed: int, pages: int = PAGES) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    return KVPool(PoolConfig(page_size=PS, num_device_pages=pages), [torch.randn(pages, PS, 3, generator=g)
                                                                     for _ in range(2)])


def _computed(pool: KVPool, tokens: list[int]) -> KVState:
    kv = KVState(TokenList(tokens))
    assert pool.allocate(kv, len(tokens))
    kv.num_computed_tokens = len(tokens)
    pool.register_computed(kv)
    pool.poll(wait=True)
    return kv


def _page_rows(pool: KVPool, page: int) -> list[torch.Tensor]:
    return [layer[page].clone() for layer in pool.kv_caches]


def test_export_then_import_moves_the_bytes_of_every_layer_and_indexes_them():
    src, dst = _pool(0), _pool(1)
    tokens = list(range(10, 10 + 2 * PS + 1))  # two full blocks and one token
    hashes = _computed(src, tokens).block_hashes[:2]
    assert len(hashes) == 2
    assert src.held_prefix(hashes) == 2 and dst.held_prefix(hashes) == 0
    got = src.export_blocks(hashes)
    assert got is not None
    names, payload = got
    assert names == hashes and payload.dtype == torch.uint8 and payload.numel() == 2 * src.block_bytes
    raw = payload.numpy().tobytes()
    n = src.block_bytes
    counts = dst.import_blocks([(h, raw[i * n:(i + 1) * n]) for i, h in enumerate(hashes)])
    assert counts == {"stored": 2, "duplicate": 0, "refused": 0}
    assert dst.held_prefix(hashes) == 2
    rows_src = src.tiers.index.match(hashes, [Tier.DEVICE])
    rows_dst = dst.tiers.index.match(hashes, [Tier.DEVICE])
    for rs, rd in zip(rows_src, rows_dst):
        for a, b in zip(_page_rows(src, int(rs[Tier.DEVICE])), _page_rows(dst, int(rd[Tier.DEVICE]))):
            assert torch.equal(a, b)
    # the same blocks again are duplicates, and nothing is overwritten
    again = dst.import_blocks([(h, raw[i * n:(i + 1) * n]) for i, h in enumerate(hashes)])
    assert again == {"stored": 0, "duplicate": 2, "refused": 0}


def test_import_refuses_blocks_without_a_free_page_and_export_misses_evicted_blocks():
    src, dst = _pool(0), _pool(1, pages=2)
    tokens = list(range(3 * PS))
    hashes = _computed(src, tokens).block_hashes
    names, payload = src.export_blocks(hashes)
    raw, n = payload.numpy().tobytes(), src.block_bytes
    kept = _computed(dst, list(range(500, 500 + 2 * PS)))  # both pages referenced by a request
    counts = dst.import_blocks([(h, raw[i * n:(i + 1) * n]) for i, h in enumerate(names)])
    assert counts == {"stored": 0, "duplicate": 0, "refused": 3}
    assert dst.held_prefix(hashes) == 0 and kept.page_ids
    assert src.export_blocks(hashes + [b"\x00" * len(hashes[0])]) is None  # one block it never held
    assert src.export_blocks([]) is not None and src.export_blocks([])[1].numel() == 0


def test_a_failed_import_copy_is_counted_and_never_indexed():
    src, dst = _pool(0), _pool(1)
    tokens = list(range(PS))
    hashes = _computed(src, tokens).block_hashes
    _, payload = src.export_blocks(hashes)

    class Failing:
        def scatter(self, *a, **k):
            raise RuntimeError("copy failed")

    real = dst.tiers.copy_engine
    dst.tiers.copy_engine = Failing()
    try:
        counts = dst.import_blocks([(hashes[0], payload.numpy().tobytes())])
    finally:
        dst.tiers.copy_engine = real
    assert counts == {"stored": 0, "duplicate": 0, "refused": 1}
    assert dst.stats().copy_errors == 1 and dst.held_prefix(hashes) == 0
    assert dst.num_free_pages == PAGES  # the page taken for it was given back
