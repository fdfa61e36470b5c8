"""Differential test of the tiered pool on a hybrid KDA + MLA model (``tiny-k3``, fp32): seeded
multi-turn sessions sharing prefixes, served with tiny device, host, disk and in-process remote
tiers (MLA blocks and recurrent-state checkpoints both evicted), give the prompt log-probs (of the
positions not reported cached), greedy tokens and token log-probs of the same requests served with
no caching at all, within 1e-4. Checkpoints are restored from every tier; a checkpoint evicted or
corrupt while its MLA blocks stay, and an MLA block lost while its checkpoint stays, fall back
to an earlier exact point and are counted."""

from __future__ import annotations

import random

from kvtier import SamplingParams
from kvtier.cache.block_hash import compose_salt
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.disk_tier import BlockMeta
from kvtier.cache.pool import KVPool
from kvtier.cache.prefix_index import Tier
from kvtier.cache.remote import RemoteTier
from kvtier.serve import Engine, EngineConfig
from kvtier.serve.hybrid_state import cache_config
from kvtier.serve.runner import ModelRunner
from tests.helpers.memory_store import MemoryBackend
from tests.helpers.hybrid_engine import llm, prompt, run  # noqa: F401 - llm is a fixture

TOL = 1e-4
PS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=True)


def cached_engine(llm, disk_dir, backend: MemoryBackend) -> Engine:
    """An engine over ``llm``'s model with 40 device pages, KV host room for 4 blocks, a disk tier
    in ``disk_dir`` and a remote tier over ``backend``; checkpoint budgets of 2 (device), 3 (host)
    and 64 (disk) checkpoints; a grid checkpoint every 2 pages; loads always preferred."""
    model = llm.engine.runner.model
    spec = model.cache_spec()
    ck = spec.state_bytes
    block = PS * spec.kv_bytes_per_token
    config = EngineConfig.of(page_size=PS, num_device_pages=40, max_num_seqs=4, host_cache_bytes=4 * block,
                             disk_cache_dir=str(disk_dir), disk_cache_bytes=64 << 20, state_checkpoint_tokens=2 * PS,
                             state_device_bytes=2 * ck, state_host_bytes=3 * -(-ck // 4096) * 4096,
                             state_disk_bytes=64 * (ck + 8192))
    runner = ModelRunner(model, cache_config(config, spec))
    salt = compose_salt(b"tiny-k3", str(model.dtype).encode())
    remote = RemoteTier(backend, BlockMeta.of_pools(runner.kv_caches), timeout_s=5.0)
    pool = KVPool(runner.config.pool_config(salt), runner.kv_caches, remote=remote)
    pool.tiers.cost_model = CostModel(tiers={t: TierCost(0.0, 1e15) for t in (Tier.HOST, Tier.DISK, Tier.REMOTE)},
                                      prefill_tok_s=1.0)
    engine = Engine(None, runner.config, runner=runner, pool=pool)
    assert "states" in engine.pool.layouts()
    return engine


class Reference:
    """The same requests on an engine with no caching, one at a time."""

    def __init__(self, llm):
        cfg = EngineConfig.of(page_size=PS, num_device_pages=40, max_num_seqs=1, enable_prefix_caching=False)
        self.engine = Engine(llm.engine.runner.model, cfg, b"tiny-k3")
        self.checked = 0

    def check(self, prompt_ids: list[int], out) -> None:
        want = run(self.engine, [prompt_ids], PARAMS)[0]
        assert want.num_cached_tokens == 0
        c = out.num_cached_tokens
        assert out.prompt_logprobs[:c] == [None] * c
        got, ref = out.prompt_logprobs[c:], want.prompt_logprobs[c:]
        assert None not in got
        assert max((abs(g - r) for g, r in zip(got, ref, strict=True)), default=0.0) <= TOL
        assert out.token_ids == want.token_ids
        assert max(abs(g - r) for g, r in zip(out.logprobs, want.logprobs, strict=True)) <= TOL
        self.checked += 1


class Sessions:
    """Seeded sessions: each turn is the previous prompt, its output and new tokens."""

    def __init__(self, n: int, seed: int):
        self.rng = random.Random(seed)
        self.prompts = [prompt(self.rng.randint(40, 70), seed * 100 + i) for i in range(n)]
        self.turn = [0] * n

    def next(self, i: int, out=None) -> list[int]:
        """Session ``i``'s next prompt (``out``: its last turn's output)."""
        if out is not None:
            self.turn[i] += 1
            self.prompts[i] = self.prompts[i] + out.token_ids + prompt(self.rng.randint(5, 30),
                                                                       1000 * (i + 1) + self.turn[i])
        return self.prompts[i]


def serve(engine: Engine, ref: Reference, prompts: list[list[int]]) -> list:
    """Serve ``prompts`` as one batch on ``engine``, check each against the reference, and wait
    for the pool's writes."""
    outs = run(engine, prompts, PARAMS)
    for p, out in zip(prompts, outs, strict=True):
        assert out.error is None
        ref.check(p, out)
    engine.pool.poll(wait=True)
    return outs


def resume_key(engine: Engine, prompt_ids: list[int]) -> tuple[int, bytes]:
    """``(k, key)``: the checkpoint the pool would resume ``prompt_ids`` from (its block count and key)."""
    pool = engine.pool
    hashes = pool.prefetcher.hash_tokens(prompt_ids[:(len(prompt_ids) - 1) // PS * PS])
    points = pool.resume_rule.points(hashes, len(hashes))
    assert points, "no checkpoint under the prompt"
    k = points[0][0]
    return k, hashes[k - 1]


def forget(engine: Engine, backend: MemoryBackend, key: bytes, keep: Tier | None = None) -> None:
    """Drop every copy of checkpoint ``key`` (the remote value too) except the one in ``keep``."""
    store = engine.pool.resume_rule.store
    for t in (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE):
        if t != keep:
            store.drop(key, t)
    if keep != Tier.REMOTE:
        backend.values.pop(store.stores[Tier.REMOTE].remote.key(key), None)


def flip_payload_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[4096 + 100] ^= 0x10  # a payload byte, after the 4096-byte header
    path.write_bytes(bytes(data))


def test_tiered_hybrid_cache_gives_what_no_cache_gives(llm, tmp_path):
    backend = MemoryBackend()
    ref = Reference(llm)
    s = Sessions(3, seed=5)

    # ---- engine 1: device, host, disk, remote ------------------------------------------------------
    e1 = cached_engine(llm, tmp_path / "disk", backend)
    first = serve(e1, ref, [s.next(i) for i in range(3)])
    assert all(o.num_cached_tokens == 0 for o in first)
    # second turns, and a branch sharing only part of session 0's first prompt; session 0 last
    branch = s.prompts[0][:s.rng.randint(PS + 1, len(s.prompts[0]) - 1)] + prompt(20, 77)
    second = serve(e1, ref, [s.next(1, first[1]), s.next(2, first[2]), branch])
    (second0,) = serve(e1, ref, [s.next(0, first[0])])
    assert all(o.num_cached_tokens > 0 for o in (*second, second0))

    # host: session 0's checkpoints lose their device copies
    store = e1.pool.resume_rule.store
    hits = dict(e1.pool.stats().sections["state"].hits)
    p0 = s.next(0, second0)
    k, key = resume_key(e1, p0)
    assert Tier.HOST in store.where(key)
    for t in list(store.where(key)):
        if t == Tier.DEVICE:
            store.drop(key, t)
    (third0,) = serve(e1, ref, [p0])
    st = e1.pool.stats().sections["state"]
    assert st.hits["host"] == hits["host"] + 1 and third0.num_cached_tokens == k * PS

    # a checkpoint evicted everywhere while its MLA blocks stay: an earlier point, tokens counted lost
    p1 = s.next(1, second[0])
    k, key = resume_key(e1, p1)
    lost = st.tokens_lost
    forget(e1, backend, key)
    (third1,) = serve(e1, ref, [p1])
    st = e1.pool.stats().sections["state"]
    assert 0 < third1.num_cached_tokens < k * PS and st.tokens_lost > lost

    # a corrupt checkpoint (its only copy, on disk) while its MLA blocks stay: fallback, counted
    p2 = s.next(2, second[1])
    k, key = resume_key(e1, p2)
    fallbacks, corrupt = st.fallbacks, st.failures["corrupt"]
    forget(e1, backend, key, keep=Tier.DISK)
    flip_payload_byte(store.stores[Tier.DISK].disk.path(key))
    (third2,) = serve(e1, ref, [p2])
    st = e1.pool.stats().sections["state"]
    assert third2.num_cached_tokens < k * PS
    assert st.fallbacks == fallbacks + 1 and st.failures["corrupt"] == corrupt + 1
    assert st.evictions["device"] > 0 and st.evictions["host"] > 0  # the budgets were tight
    assert e1.pool.stats().hit_tokens["host"] + e1.pool.stats().hit_tokens["device"] > 0
    e1.pool.close()

    # ---- engine 2: a fresh engine over the same disk directory ------------------------------------
    e2 = cached_engine(llm, tmp_path / "disk", backend)
    (fourth0,) = serve(e2, ref, [s.next(0, third0)])
    st = e2.pool.stats().sections["state"]
    assert fourth0.num_cached_tokens > 0 and st.hits["disk"] == 1
    assert fourth0.cached_tokens_by_tier["disk"] > 0

    # an MLA block lost (its disk file corrupt) while its checkpoint stays: an earlier point
    p1 = s.next(1, third1)
    k, key = resume_key(e2, p1)
    hashes = e2.pool.prefetcher.hash_tokens(p1[:k * PS])
    flip_payload_byte(e2.pool.tiers.disk.path(hashes[k - 1]))
    (fourth1,) = serve(e2, ref, [p1])
    st = e2.pool.stats().sections["state"]
    assert fourth1.num_cached_tokens < k * PS and st.fallbacks == 1 and sum(st.failures.values()) == 0
    e2.pool.close()

    # ---- engine 3: a fresh engine with an empty disk, over the same remote store -------------------
    e3 = cached_engine(llm, tmp_path / "disk3", backend)
    (fourth2,) = serve(e3, ref, [s.next(2, third2)])
    st = e3.pool.stats().sections["state"]
    assert fourth2.num_cached_tokens > 0 and st.hits["remote"] == 1
    assert fourth2.cached_tokens_by_tier["remote"] > 0
    e3.pool.close()
    assert ref.checked == 13
