"""Resume parity: turn 2 of a session whose prefix (MLA blocks and the recurrent-state checkpoint at
their end) is restored from the host tier, or from disk by a fresh engine, equals a cold run of the
same tokens in transformers' ``KimiLinearForCausalLM`` (fp32, within 1e-4), on the random tiny
``kimi_linear`` model of the parity harness (tests/model/test_kimi_linear_parity.py)."""

from __future__ import annotations

import pytest
import torch

from kvtier import SamplingParams
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.prefix_index import Tier
from kvtier.serve import Engine, EngineConfig
from tests.hf_reference import hf_log_softmax
from tests.helpers.kimi_linear_pair import ATOL, CONFIG, pair  # noqa: F401 - pair is a fixture
from tests.helpers.hybrid_engine import run

PS = 16
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=True)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_over(model, disk_dir) -> Engine:
    """16 device pages, a host and a disk tier; loads always preferred to recomputing."""
    cfg = EngineConfig.of(page_size=PS, num_device_pages=16, max_num_seqs=2, host_cache_bytes=4 << 20,
                          disk_cache_dir=str(disk_dir), disk_cache_bytes=64 << 20)
    engine = Engine(model, cfg, b"kimi-linear-parity")
    engine.pool.tiers.cost_model = CostModel(tiers={t: TierCost(0.0, 1e15) for t in (Tier.HOST, Tier.DISK)},
                                             prefill_tok_s=1.0)
    return engine


def assert_matches_transformers(hf, prompt_ids: list[int], out) -> None:
    """``out``'s uncached prompt log-probs, greedy tokens and their log-probs equal transformers'
    cold run over the prompt and the output."""
    lp = hf_log_softmax(hf, prompt_ids + out.token_ids[:-1]).double()
    n, c = len(prompt_ids), out.num_cached_tokens
    want = [lp[p, prompt_ids[p + 1]].item() for p in range(n - 1)]
    assert out.prompt_logprobs[:c] == [None] * c
    diff = torch.tensor(out.prompt_logprobs[c:], dtype=torch.float64) - torch.tensor(want[c:], dtype=torch.float64)
    assert float(diff.abs().max()) <= ATOL
    rows = lp[n - 1:]
    assert out.token_ids == rows.argmax(-1).tolist()
    got = torch.tensor(out.logprobs, dtype=torch.float64)
    assert float((got - rows.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)).abs().max()) <= ATOL


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("source", ["host", "disk"])
def test_turn_two_restored_equals_a_cold_transformers_run(pair, tmp_path, one_thread, source):
    hf, ours = pair
    engine = engine_over(ours, tmp_path)
    first = ids(90, 1)
    (out1,) = run(engine, [first], PARAMS)
    assert_matches_transformers(hf, first, out1)
    second = first + out1.token_ids + ids(25, 2)
    engine.pool.poll(wait=True)
    if source == "host":
        run(engine, [ids(15 * PS, 3)], SamplingParams(max_tokens=1))  # takes every device page
        engine.pool.poll(wait=True)
        store = engine.pool.resume_rule.store
        for key in engine.pool.prefetcher.hash_tokens(second[:(len(second) - 1) // PS * PS]):
            store.drop(key, Tier.DEVICE)  # checkpoints come back from host memory
    else:
        engine.pool.close()
        engine = engine_over(ours, tmp_path)  # a fresh engine: only the disk tier holds anything
    (out2,) = run(engine, [second], PARAMS)
    assert out2.num_cached_tokens >= 80  # the checkpoint at the prompt's last page boundary (90 -> 80) or later
    assert out2.cached_tokens_by_tier[source] > 0
    state = engine.pool.stats().sections["state"]
    assert state.hits[source] == 1 and sum(state.hits.values()) == 1
    assert_matches_transformers(hf, second, out2)
    engine.pool.close()
