"""Two engines, one remote store: what engine A wrote, a fresh engine B loads, with the outputs of
recomputation; corrupt, missing or unreachable remote blocks are recomputed, never errors."""

import pytest
import redis
import torch

from kvtier import LLM, SamplingParams
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.prefix_index import Tier
from tests.stores import start_mooncake, start_redis

PS = 16
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
HIT = 170 // PS * PS


def prompt(n, seed):
    return torch.randint(0, 163840, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(url, **kw):
    llm = LLM("tiny", page_size=PS, num_device_pages=64, host_cache_bytes=8 << 20, remote_cache_url=url,
              remote_timeout_s=2.0, **kw)
    llm.engine.pool.tiers.cost_model = CostModel(tiers={t: TierCost(0.0, 1e15) for t in Tier}, prefill_tok_s=1.0)
    return llm


@pytest.fixture(scope="module")
def shared():
    first = prompt(200, 1)
    second = first[:170] + prompt(30, 2)
    ref = LLM("tiny", page_size=PS, num_device_pages=64, enable_prefix_caching=False)
    return first, second, ref.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]


def write_with_a(url, first):
    a = engine(url)
    a.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    a.engine.pool.poll(wait=True)
    assert a.engine.pool.stats().bytes_written["remote"] >= 200 // PS * a.engine.pool.block_bytes
    return a


def assert_same_as_recompute(out, want, hit):
    assert out.num_cached_tokens == hit
    got = torch.tensor(out.prompt_logprobs[hit:], dtype=torch.float64)
    ref = torch.tensor(want.prompt_logprobs[hit:], dtype=torch.float64)
    assert float((got - ref).abs().max()) <= 1e-4
    assert out.token_ids == want.token_ids


def test_engine_b_reads_what_engine_a_wrote(any_store, shared):
    first, second, want = shared
    a = write_with_a(any_store.url, first)
    b = engine(any_store.url)
    out = b.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert out.cached_tokens_by_tier["remote"] == HIT
    assert b.engine.pool.stats().hit_tokens["remote"] == HIT
    assert_same_as_recompute(out, want, HIT)
    b.engine.pool.close()
    a.engine.pool.close()


def test_corrupt_and_missing_remote_blocks_are_recomputed(redis_store, shared):
    first, second, _ = shared
    salt_engine = engine(redis_store.url, salt=b"corrupt")
    salt_engine.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    pool = salt_engine.engine.pool
    pool.poll(wait=True)
    client = redis.Redis.from_url(redis_store.url)
    keys = [pool.tiers.remote.key(h) for h in _chain(salt_engine, first)]
    value = bytearray(client.get(keys[4]))
    value[-1] ^= 0xFF
    client.set(keys[4], bytes(value))  # block 4 corrupt: blocks 0-3 load, the rest is recomputed
    b = engine(redis_store.url, salt=b"corrupt")
    out = b.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert out.cached_tokens_by_tier["remote"] == 4 * PS and b.engine.pool.stats().sections["remote"].gets["corrupt"] == 1
    assert_same_as_recompute(out, _reference(second, b"corrupt"), 4 * PS)
    client.delete(keys[2])  # block 2 missing: a fresh engine loads blocks 0-1 only
    c = engine(redis_store.url, salt=b"corrupt")
    out = c.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert out.cached_tokens_by_tier["remote"] == 2 * PS
    assert_same_as_recompute(out, _reference(second, b"corrupt"), 2 * PS)
    client.close()


@pytest.mark.parametrize("start", [start_redis, start_mooncake], ids=["redis", "mooncake"])
def test_store_killed_mid_run_every_request_is_answered(tmp_path, shared, start):
    first, second, want = shared
    store = start(tmp_path)
    a = write_with_a(store.url, first)
    b = engine(store.url)
    b.generate(prompt_token_ids=[prompt(40, 9)], sampling_params=PARAMS)  # connected and serving
    pool = b.engine.pool
    rows = pool.tiers.index.match(_chain(a, first)[:HIT // PS], [Tier.REMOTE])
    assert len(rows) == 0
    pool.reuse._match_remote(_chain(a, first)[:HIT // PS], rows)  # B has seen A's blocks in the store
    store.stop()
    outs = b.generate(prompt_token_ids=[second, prompt(60, 10)], sampling_params=PARAMS)
    assert_same_as_recompute(outs[0], want, 0)
    assert len(outs[1].token_ids) == PARAMS.max_tokens
    assert pool.stats().sections["remote"].misses >= 1 and pool.stats().copy_errors == 0
    again = b.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]  # from B's own device pages
    assert_same_as_recompute(again, want, again.num_cached_tokens)


def test_unreachable_store_at_start_up_names_the_url():
    with pytest.raises(RuntimeError, match="redis://127.0.0.1:1"):
        LLM("tiny", page_size=PS, num_device_pages=16, host_cache_bytes=8 << 20, remote_cache_url="redis://127.0.0.1:1")


@pytest.mark.parametrize("kw, match", [(dict(remote_cache_url="ftp://x:1", host_cache_bytes=1 << 20), "remote_cache_url"),
                                       (dict(remote_cache_url="redis://127.0.0.1:1"), "host_cache_bytes"),
                                       (dict(remote_timeout_s=0), "remote_timeout_s")])
def test_bad_remote_options_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny", page_size=PS, num_device_pages=16, **kw)


def _chain(llm, tokens):
    from kvtier.cache.block_hash import block_hashes
    pool = llm.engine.pool
    return block_hashes(tokens[:len(tokens) // PS * PS], PS, None, pool.config.salt)


def _reference(tokens, salt):
    ref = LLM("tiny", page_size=PS, num_device_pages=64, enable_prefix_caching=False, salt=salt)
    return ref.generate(prompt_token_ids=[tokens], sampling_params=PARAMS)[0]
