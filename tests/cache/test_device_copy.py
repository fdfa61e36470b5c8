"""The GPU copy path (:mod:`kvtier.cache.device_copy`) driven through the pool, without the
serving layer: on CPU through :class:`CpuStreams` with a deferred copy stream (a copy is "in
flight" while queued), on a GPU (tests marked ``gpu``) through CUDA/HIP streams with the copy
stream held behind a sleeping compute stream."""

import pytest
import torch

from kvtier import ops
from kvtier.cache import device_copy
from kvtier.cache.cost_model import CostModel, TierCost
from kvtier.cache.config import PoolConfig
from kvtier.cache.device_copy import DeviceCopyEngine, check_device_tiers
from kvtier.cache.kv_state import KVState, TokenList
from kvtier.cache.pool import KVPool, PrefixStart
from kvtier.cache.prefix_index import Tier
from kvtier.cache.streams import CpuStreams, CudaStreams
from kvtier.transfer import CopyEngine

PS, LAYERS, ROW, PAGES = 4, 3, 24, 16
GPU = pytest.mark.gpu
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[GPU, NEEDS_GPU])]


def State(seq_id: int, tokens: list[int]) -> KVState:
    """A request's KV state as the pool sees it, no serving layer (``seq_id`` only names it here)."""
    return KVState(TokenList(tokens))


def finish(pool, s):
    """Wait for ``s``'s loads; the caller (a scheduler) advances its progress by what was placed."""
    placed = pool.finish_prefix(s)
    while placed is None:
        pool.wait_for_loads(0.05)
        placed = pool.finish_prefix(s)
    s.num_computed_tokens = placed
    return placed


class Path:
    """A device copy engine whose copies stay in flight until :meth:`release`."""

    def __init__(self, device):
        self.device = device
        self.streams = CpuStreams(deferred=True) if device == "cpu" else CudaStreams(device)
        self.engine = DeviceCopyEngine(device, self.streams)

    def hold(self):
        """Copies submitted from now on wait behind compute work that is still running."""
        if self.device != "cpu":
            torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU cycles on the compute stream

    def release(self):
        if self.device == "cpu":
            self.streams.run_pending()
        else:
            torch.cuda.synchronize()


def make_pool(path, pages=PAGES, write_policy="write-through"):
    config = PoolConfig(page_size=PS, num_device_pages=pages, host_cache_bytes=64 * LAYERS * PS * ROW * 4,
                        write_policy=write_policy)
    pools = [torch.full((pages, PS, ROW), float("nan"), device=path.device) for _ in range(LAYERS)]
    always_load = CostModel(tiers={Tier.HOST: TierCost(0.0, 1e15)}, prefill_tok_s=1.0)
    return KVPool(config, pools, always_load, copy_engine=path.engine)


def page_data(token_block: int) -> torch.Tensor:
    """[LAYERS, PS, ROW] distinct values of one block's KV."""
    return torch.arange(LAYERS * PS * ROW, dtype=torch.float32).view(LAYERS, PS, ROW) + 1000.0 * token_block


def compute(pool, s, n_blocks):
    """Pretend a forward wrote ``n_blocks`` blocks of ``s`` (block b holds page_data(b))."""
    assert pool.allocate(s, n_blocks * PS)
    for b, page in enumerate(s.page_ids[:n_blocks]):
        for layer, pool_l in enumerate(pool.kv_caches):
            pool_l[page] = page_data(b)[layer].to(pool_l.device)
    s.num_computed_tokens = n_blocks * PS
    pool.register_computed(s)


def evict_device_copies(pool):
    """Take every free page once (evicting cached device copies), then give them back."""
    filler = State(99, list(range(10_000, 10_000 + PS * pool.num_free_pages)))
    assert pool.allocate(filler, filler.num_tokens)
    pool.free(filler)


def host_copies(path, n_blocks=5):
    """A pool whose host tier holds blocks 0..n_blocks-1 of a prompt, none of them on the device."""
    pool = make_pool(path)
    tokens = list(range(n_blocks * PS + 1))
    first = State(1, tokens)
    compute(pool, first, n_blocks)
    path.release()
    pool.poll(wait=True)
    pool.free(first)
    evict_device_copies(pool)
    return pool, tokens


@pytest.mark.parametrize("device", DEVICES)
def test_gather_scatter_match_the_native_layout(device):
    path = Path(device)
    pools = [torch.randn(PAGES, PS, ROW, device=device) for _ in range(LAYERS)]
    block = LAYERS * PS * ROW * 4
    host = torch.empty(3 * block, dtype=torch.uint8, pin_memory=device != "cpu")
    h = path.engine.gather(pools, [5, 0, 11], host)
    assert h.result() == [0, 0, 0]
    native = torch.empty(3 * block, dtype=torch.uint8)
    assert CopyEngine(1).gather([p.cpu() for p in pools], [5, 0, 11], native).result() == [0, 0, 0]
    assert torch.equal(host, native)
    assert path.engine.scatter(host, pools, [7, 8, 9]).result() == [0, 0, 0]
    for p in pools:
        assert torch.equal(p[[7, 8, 9]], p[[5, 0, 11]])


@pytest.mark.parametrize("device", DEVICES)
def test_a_page_freed_while_its_write_out_is_in_flight_is_not_reused(device):
    path = Path(device)
    pool = make_pool(path)
    s = State(1, list(range(5 * PS + 1)))
    path.hold()
    compute(pool, s, 5)  # write-through: five device -> host copies start
    written = list(s.page_ids[:5])
    pool.free(s)
    in_flight = [w for w in pool.writes.pending if not w.handle.done()]
    if device == "cpu":
        assert len(in_flight) == 5
    for w in in_flight:  # held by its copy: neither free nor indexed on the host yet
        assert w.page not in pool.pages.free_pages and not pool.tiers.in_tier(w.hash, Tier.HOST)
    other = State(2, list(range(500, 500 + PS * pool.num_free_pages)))
    assert pool.allocate(other, other.num_tokens) and not set(other.page_ids) & {w.page for w in in_flight}
    pool.free(other)
    path.release()
    pool.poll()
    assert all(p in pool.pages.free_pages for p in written) and not pool.writes.pending
    for b, h in enumerate(s.block_hashes[:5]):
        slot = int(pool.tiers.index.match([h], [Tier.HOST])[0][Tier.HOST])
        got = pool.tiers.host.slot(slot).view(torch.float32).view(LAYERS, PS, ROW)
        assert torch.equal(got, page_data(b))


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_that_fails_mid_way_serves_nothing_it_wrote(device, monkeypatch):
    """The five host blocks of a prefix load in one job; the job writes two blocks and one
    layer of the third, then fails: none of its blocks is used or indexed, each is counted,
    and every page is free again (the request recomputes the prefix)."""
    path = Path(device)
    pool, tokens = host_copies(path)
    calls = []

    def half_then_fail(staging, kv_pools, pages):
        calls.append(pages)
        ops.scatter_pages(staging[:2].contiguous(), kv_pools, pages[:2])
        ops.scatter_pages(staging[2:3, :1].contiguous(), kv_pools[:1], pages[2:3])
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(device_copy, "_scatter_kernel", half_then_fail)
    s = State(3, tokens)
    path.hold()
    assert pool.begin_prefix(s) is PrefixStart.LOADING
    pages = list(s.page_ids)
    path.release()
    finish(pool, s)
    assert len(calls) == 1 and len(calls[0]) == 5
    assert s.num_computed_tokens == 0 and s.page_ids == []
    assert pool.stats().copy_errors == 5
    for p in pages:  # free, indexed nowhere
        assert p in pool.pages.free_pages and pool.pages.page_hash[p] is None
    assert pool.tiers.index.match(s.block_hashes[:5], [Tier.DEVICE]).shape[0] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_cancelled_mid_way_gives_back_every_page_and_can_run_again(device):
    path = Path(device)
    pool, tokens = host_copies(path)
    free_before = pool.num_free_pages
    s = State(4, tokens)
    path.hold()
    assert pool.begin_prefix(s) is PrefixStart.LOADING
    assert pool.finish_prefix(s) is None  # its one copy job (five host blocks) is in flight
    pool.free(s)  # preempted or aborted while loading
    assert pool.num_free_pages == free_before and s.page_ids == [] and not pool.loading
    assert pool.tiers.index.match(s.block_hashes[:5], [Tier.DEVICE]).shape[0] == 0  # nothing served from it
    again = State(5, tokens)
    assert pool.begin_prefix(again) in (PrefixStart.LOADING, PrefixStart.READY)  # host copies unlocked
    path.release()
    finish(pool, again)
    assert again.num_computed_tokens == 5 * PS and again.prefix_tokens_by_tier["host"] == 5 * PS


def test_a_load_result_orders_compute_after_it():
    streams = CpuStreams(deferred=True)
    engine = DeviceCopyEngine("cpu", streams)
    pools = [torch.zeros(4, PS, ROW) for _ in range(LAYERS)]
    host = page_data(1).view(torch.uint8).reshape(-1).clone()
    h = engine.scatter(host, pools, [2])
    assert not h.done()
    assert h.wait(0.0)  # a CPU copy stream runs when waited for
    assert h.result() == [0]
    seq = streams.log[-1][1]
    assert streams.log[-2:] == [("copy", seq), ("compute_wait", seq)]
    assert torch.equal(torch.stack([p[2] for p in pools]), page_data(1))


def test_bad_staging_and_bad_streams_are_named():
    engine = DeviceCopyEngine("cpu")
    pools = [torch.zeros(4, PS, ROW)]
    with pytest.raises(ValueError, match="staging must be a contiguous CPU tensor of at least"):
        engine.gather(pools, [0, 1], torch.empty(10, dtype=torch.uint8))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CudaStreams needs a CUDA/ROCm device"):
            CudaStreams("cuda")
    h = engine.gather(pools, [7], torch.empty(PS * ROW * 4, dtype=torch.uint8))  # page out of range
    with pytest.raises(Exception, match="pages must be in"):
        h.result()


def test_gpu_pools_without_page_kernels_or_with_too_much_pinned_memory_fail_at_construction(monkeypatch):
    meta = [torch.empty(8, PS, ROW, device="meta")]  # a device where no page kernel runs
    config = PoolConfig(page_size=PS, num_device_pages=8, host_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"host_cache_bytes=1048576 .* need the GPU page kernels"):
        KVPool(config, meta)
    check_device_tiers(0, None, meta)  # a device-only pool needs neither
    import kvtier.cache.device_copy as dc
    import kvtier.ops.dispatch as dispatch

    monkeypatch.setattr(dispatch, "unavailable_reason", lambda op, backend, device="cpu": None)
    monkeypatch.setattr(dc, "available_host_bytes", lambda: 10 << 20)
    with pytest.raises(ValueError, match=r"host_cache_bytes=9,000,000 exceeds the pinned memory"):
        check_device_tiers(9_000_000, None, meta)
    check_device_tiers(8_000_000, None, meta)


@pytest.mark.parametrize("device", DEVICES)
def test_the_pool_picks_its_copy_engine_by_the_pools_device(device):
    config = PoolConfig(page_size=PS, num_device_pages=8, host_cache_bytes=8 * LAYERS * PS * ROW * 4)
    pool = KVPool(config, [torch.zeros(8, PS, ROW, device=device) for _ in range(LAYERS)])
    if device == "cpu":
        assert isinstance(pool.tiers.copy_engine, CopyEngine)  # memcpy on worker threads
    else:
        assert isinstance(pool.tiers.copy_engine, DeviceCopyEngine) and isinstance(pool.tiers.copy_engine.streams, CudaStreams)
        assert pool.tiers.host.storage.is_pinned()
    assert Tier.HOST in pool.tiers.cost_model.tiers  # the host tier was probed through it
