"""The load decision in one array pass agrees with its definition, block by block: take the
prefix length k with the largest ``recompute_s(k * page_size) - load time``, where each tier's
latency is paid once per prefix and its bandwidth per block."""

import numpy as np
import pytest

from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.prefix_index import Tier
from kvtier.cache.tiers import PoolTiers


def reference_blocks_to_load(model: CostModel, sources, block_bytes: int, page_size: int) -> int:
    best_k, best_saving, spent, paid = 0, 0.0, 0.0, set()
    for k, tier in enumerate(sources, start=1):
        if tier != Tier.DEVICE:
            cost = model.tiers[tier]
            spent += block_bytes / cost.bandwidth_Bps + (0.0 if tier in paid else cost.latency_s)
            paid.add(tier)
        saving = model.recompute_s(k * page_size) - spent
        if saving > best_saving:
            best_k, best_saving = k, saving
    return best_k


def reference_load_s(model: CostModel, sources, block_bytes: int) -> float:
    tiers = [t for t in sources if t != Tier.DEVICE]
    return sum(model.tiers[t].latency_s for t in set(tiers)) + sum(
        block_bytes / model.tiers[t].bandwidth_Bps for t in tiers)


@pytest.mark.parametrize("seed", range(40))
def test_blocks_to_load_and_prefix_load_s_match_the_block_by_block_definition(seed):
    rng = np.random.default_rng(seed)
    model = CostModel(prefill_tok_s=float(rng.uniform(50, 5000)))
    for tier in (Tier.HOST, Tier.DISK, Tier.REMOTE):  # from far faster to far slower than recompute
        model.tiers[tier] = TierCost(latency_s=float(rng.uniform(0, 0.05)), bandwidth_Bps=float(10 ** rng.uniform(4, 10)))
    n = int(rng.integers(0, 300))
    # runs of one tier, as real prefixes have (device first, then lower tiers), and mixed ones
    sources = [Tier(int(t)) for t in (np.sort(rng.integers(0, 4, n)) if seed % 2 else rng.integers(0, 4, n))]
    block_bytes, page_size = int(rng.integers(1, 1 << 20)), int(rng.choice([1, 16, 64]))
    assert model.blocks_to_load(sources, block_bytes, page_size) == reference_blocks_to_load(
        model, sources, block_bytes, page_size)
    assert model.prefix_load_s(sources, block_bytes) == pytest.approx(reference_load_s(model, sources, block_bytes),
                                                                      rel=1e-9, abs=1e-12)


def test_nothing_to_load_costs_nothing():
    model = CostModel()
    assert model.blocks_to_load([], 4096, 16) == 0 and model.prefix_load_s([], 4096) == 0.0
    assert model.prefix_load_s([Tier.DEVICE] * 5, 4096) == 0.0
    assert model.blocks_to_load([Tier.DEVICE] * 5, 4096, 16) == 5  # device hits only save time


def test_best_sources_is_the_fastest_tier_holding_each_row():
    rng = np.random.default_rng(0)
    rows = np.where(rng.random((500, 4)) < 0.4, rng.integers(0, 100, (500, 4)), -1)
    rows[rows.max(axis=1) < 0, 3] = 7  # a matched row has a copy somewhere
    assert PoolTiers.best_sources(rows) == [next(t for t in Tier if r[t] >= 0) for r in rows]
    assert PoolTiers.fastest_tiers(rows).tolist() == PoolTiers.best_sources(rows)
    assert PoolTiers.best_sources(np.empty((0, 4), dtype=np.int64)) == []
    assert PoolTiers.fastest_tiers(np.empty((0, 4), dtype=np.int64)).tolist() == []
