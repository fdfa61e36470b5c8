"""Model-free pool tests' tools: a fake clock, a sequence computed through the pool, device residency."""

from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.prefix_index import Tier


PS = 4


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def run(pool, tokens, sid):
    """Compute a sequence fully (fake model: the pages keep whatever they hold) and free it."""
    s = KVState(TokenList(tokens))
    pool.begin_prefix(s)
    while pool.finish_prefix(s) is None:
        pool.wait_for_loads(0.1)
    s.num_computed_tokens = pool.finish_prefix(s)
    assert pool.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    pool.register_computed(s)
    pool.poll(wait=True)
    pool.free(s)
    return s


def on_device(pool, hashes):
    return [pool.tiers.index.match([h], [Tier.DEVICE]).shape[0] == 1 for h in hashes]
