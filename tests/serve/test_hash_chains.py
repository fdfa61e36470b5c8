"""A hash chain from outside never makes the engine use a block it has not verified, and blocks
of another salt in a shared disk directory are never served."""

import numpy as np
import pytest

from kvtier import LLM, SamplingParams
from kvtier.cache import block_hashes
from kvtier.cache.block_hash import compose_salt
from kvtier.cache.prefix_index import Tier
from kvtier.cache.config import PoolConfig
from kvtier.serve.config import EngineConfig
from tests.helpers.serving import always_load, prompt
from tests.helpers.tiers import flush_device

PS, BLOCK = 16, 15360
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=True, ignore_eos=True)


def tenant(path, salt, **kw):
    args = dict(page_size=PS, num_device_pages=17, host_cache_bytes=2 * BLOCK, disk_cache_dir=str(path),
                disk_cache_bytes=64 << 20, salt=salt.encode())
    return always_load(LLM("tiny", **{**args, **kw}))


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    """Tenant A's blocks of ``p`` on disk in a directory tenant B also uses."""
    path = tmp_path_factory.mktemp("shared")
    p = prompt(6 * PS + 5, 77)
    a = tenant(path, "tenant-a")
    a.generate(prompt_token_ids=[p], sampling_params=PARAMS)
    a.engine.pool.poll(wait=True)
    return path, p, block_hashes(p, PS, salt=a.engine.block_hash_salt)


def _mixes(own, foreign):
    n = len(own)
    return {
        "first-foreign": foreign[:1] + own[1:],
        "all-foreign": list(foreign),
        "last-foreign": own[:-1] + foreign[-1:],
        "several-foreign": [foreign[i] if i % 2 == 0 else own[i] for i in range(n)],
        "foreign-prefix": foreign[:3],
    }


@pytest.mark.parametrize("mix", sorted(_mixes([b"x"], [b"y"])))
def test_chain_with_foreign_hashes_is_rejected_and_nothing_foreign_is_served(shared_dir, mix):
    path, p, a_hashes = shared_dir
    b = tenant(path, f"tenant-b-{mix}")
    assert b.engine.pool.tiers.index.num_copies(Tier.DISK) == 0  # A's files are not B's blocks
    assert b.engine.pool.tiers.index.match(a_hashes).shape[0] == 0
    own = block_hashes(p, PS, salt=b.engine.block_hash_salt)
    bad = _mixes(own, a_hashes)[mix]
    with pytest.raises(ValueError, match="prompt_block_hashes.*does not match"):
        b.engine.add_request(np.asarray(p), PARAMS, prompt_block_hashes=bad)
    assert not b.engine.has_unfinished()
    b.engine.add_request(np.asarray(p), PARAMS, prompt_block_hashes=own)  # its own chain is fine
    out = []
    while b.engine.has_unfinished():
        out += b.engine.step()
    assert out[0].num_cached_tokens == 0  # nothing of A's was served


def test_same_salt_on_the_shared_directory_is_served(shared_dir):
    path, p, a_hashes = shared_dir
    again = tenant(path, "tenant-a")
    assert again.engine.pool.tiers.index.num_copies(Tier.DISK) >= 6
    out = again.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0]
    assert out.cached_tokens_by_tier["disk"] > 0


def test_another_prompts_chain_on_one_engine_is_rejected(tmp_path):
    llm = tenant(tmp_path, "")
    eng = llm.engine
    p, q = prompt(4 * PS + 3, 1), prompt(4 * PS + 3, 2)
    llm.generate(prompt_token_ids=[q], sampling_params=PARAMS)  # q's blocks are cached
    salt = eng.block_hash_salt
    hq, hp = block_hashes(q, PS, salt=salt), block_hashes(p, PS, salt=salt)
    # The last hash is consistent with its parent and its page (all the old check looked at);
    # the hashes before it are q's, whose blocks the engine holds.
    forged = hq[:3] + block_hashes(p[3 * PS:4 * PS], PS, hq[2], salt)
    for bad in (forged, hq, hq[:2] + hp[2:], hp[:1] + hq[1:2]):
        with pytest.raises(ValueError, match="prompt_block_hashes.*does not match"):
            eng.add_request(p, PARAMS, prompt_block_hashes=bad)
    assert not eng.has_unfinished()


def test_a_correct_chain_is_used(tmp_path):
    llm = tenant(tmp_path, "t")
    p = prompt(5 * PS + 1, 3)
    first = llm.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0]
    flush_device(llm)
    chain = block_hashes(p, PS, salt=llm.engine.block_hash_salt)[:4]
    rid = llm.engine.add_request(p, PARAMS, prompt_block_hashes=chain)
    outs = []
    while llm.engine.has_unfinished():
        outs += llm.engine.step()
    assert outs[0].request_id == rid and outs[0].num_cached_tokens > 0
    assert outs[0].token_ids == first.token_ids


def test_salt_parts_are_length_prefixed():
    assert compose_salt(b"ab", b"c") != compose_salt(b"a", b"bc")
    cfg = EngineConfig(pool=PoolConfig(salt=b"x"))
    assert cfg.pool_config(b"m").salt != EngineConfig(pool=PoolConfig(salt=b"mx")).pool_config(b"").salt
    dtype_in_salt = EngineConfig(pool=PoolConfig(salt=b"torch.float32")).pool_config(compose_salt(b"", b"torch.float32"))
    assert dtype_in_salt.salt != EngineConfig().pool_config(compose_salt(b"torch.float32", b"torch.float32")).salt
