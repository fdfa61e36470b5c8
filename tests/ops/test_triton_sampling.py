"""``sample`` with ``backend="triton"`` (interpreter on CPU): greedy = argmax exactly, temperature
and top-p frequencies, the packed bitmask in the same kernel, determinism for a seeded generator."""

from __future__ import annotations

import pytest
import torch

from kvtier import ops
from tests.helpers.sampling_checks import _assert_frequencies, _pack_bitmask


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _draws(logits_row, n, *, temperature=1.0, top_p=1.0, seed=0, bitmask_row=None):
    logits = logits_row[None, :].expand(n, -1).contiguous()
    mask = None if bitmask_row is None else bitmask_row[None, :].expand(n, -1).contiguous()
    gen = torch.Generator().manual_seed(seed)
    return ops.sample(logits, torch.full((n,), temperature), torch.full((n,), top_p), mask, gen, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("batch, vocab", [(1, 17), (3, 1000), (17, 2100)])
def test_greedy_equals_argmax_exactly(dtype, batch, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype)
    logits[0, vocab // 2] = logits[0, 3] = logits[0].float().max() + 1  # a tie: the lower id wins
    temperature = torch.zeros(batch)
    temperature[1::2] = -1.0
    got = ops.sample(logits, temperature, torch.full((batch,), 0.7), backend="triton")
    assert torch.equal(got, logits.float().argmax(-1))
    assert got[0].item() == 3


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_frequencies_match_softmax_over_temperature(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, -3.0])
    n = 6000
    tokens = _draws(logits, n, temperature=temperature, seed=7)
    _assert_frequencies(tokens, torch.softmax(logits.double() / temperature, dim=0), n)


def test_top_p_keeps_smallest_prefix_and_renormalises():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3], dtype=torch.float64)  # unsorted on purpose
    n = 2500
    tokens = _draws(probs.log().float(), n, top_p=0.7, seed=3)
    assert set(tokens.unique().tolist()) == {1, 3}
    _assert_frequencies(tokens, torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]), n)


def test_top_p_and_temperature_over_a_wide_vocab():
    """Many chunks (vocab > BLOCK): the cut and the CDF walk cross chunk boundaries."""
    vocab = 1100
    logits = torch.full((vocab,), -30.0)
    hot = torch.tensor([5, 1023, 1024, 1099])
    logits[hot] = torch.tensor([2.0, 1.5, 1.0, 0.0])
    n = 1200
    tokens = _draws(logits, n, temperature=0.8, top_p=0.9, seed=11)
    p = torch.softmax(logits.double() / 0.8, 0)[hot]
    keep = (p.cumsum(0) - p) < 0.9 * p.sum() / p.sum()  # p already sums to ~1
    want = torch.zeros(len(hot), dtype=torch.float64)
    want[keep] = p[keep] / p[keep].sum()
    index = {t: i for i, t in enumerate(hot.tolist())}
    assert set(tokens.tolist()) <= set(hot[keep].tolist())
    _assert_frequencies(torch.tensor([index[t] for t in tokens.tolist()]), want, n)


def test_tiny_top_p_is_argmax():
    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(1)) * 3
    got = ops.sample(logits, torch.ones(40), torch.full((40,), 1e-6), generator=torch.Generator().manual_seed(0),
                     backend="triton")
    assert torch.equal(got, logits.argmax(-1))


def test_bitmask_never_yields_disallowed_token():
    vocab = 100
    allowed = [3, 31, 32, 99]  # sign bit of word 0, a partial last word
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(9))
    logits[[0, 30, 50, 98]] = 20.0
    n = 3000
    tokens = _draws(logits, n, seed=10, bitmask_row=_pack_bitmask(allowed, vocab))
    assert set(tokens.tolist()) == set(allowed)
    probs = torch.softmax(logits.double()[allowed], dim=0)
    _assert_frequencies(torch.tensor([allowed.index(t) for t in tokens.tolist()]), probs, n)
    top = _draws(logits, 500, top_p=0.5, seed=12, bitmask_row=_pack_bitmask(allowed, vocab))
    assert set(top.tolist()) <= set(allowed)


def test_bitmask_greedy_and_single_allowed_token():
    vocab = 70
    logits = torch.arange(vocab, dtype=torch.float32)[None].repeat(3, 1)
    logits[2, 7] = -50.0  # the only allowed token, far below the disallowed ones
    masks = torch.stack([_pack_bitmask([5, 40], vocab), _pack_bitmask([63, 64], vocab), _pack_bitmask([7], vocab)])
    got = ops.sample(logits, torch.zeros(3), torch.ones(3), masks, backend="triton")
    assert got.tolist() == [40, 64, 7]
    assert ops.sample(logits[2:], torch.ones(1), torch.full((1,), 0.5), masks[2:], backend="triton").item() == 7
    sampled = ops.sample(logits[:2], torch.ones(2), torch.full((2,), 0.3), masks[:2],
                         generator=torch.Generator().manual_seed(0), backend="triton")
    assert sampled[0].item() in (5, 40) and sampled[1].item() in (63, 64)


def test_all_masked_row_is_a_clear_error():
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1
    with pytest.raises(ValueError, match=r"token_bitmask allows no token in row\(s\) \[1\]"):
        ops.sample(torch.zeros(2, 40), torch.ones(2), torch.ones(2), mask, backend="triton")


def test_seeded_generator_is_deterministic_and_greedy_draws_nothing():
    logits = torch.randn(128, 50, generator=torch.Generator().manual_seed(0))
    temp, top_p = torch.full((128,), 1.3), torch.full((128,), 0.95)
    a = ops.sample(logits, temp, top_p, generator=torch.Generator().manual_seed(1234), backend="triton")
    b = ops.sample(logits, temp, top_p, generator=torch.Generator().manual_seed(1234), backend="triton")
    c = ops.sample(logits, temp, top_p, generator=torch.Generator().manual_seed(4321), backend="triton")
    assert torch.equal(a, b) and not torch.equal(a, c)
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    ops.sample(logits[:3], torch.zeros(3), torch.ones(3), generator=g, backend="triton")
    assert torch.equal(g.get_state(), state)


@pytest.mark.slow
def test_frequencies_large_sample_over_k2_sized_chunks():
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(3000, generator=gen) - 10
    logits[:6] = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5])
    n = 10000
    tokens = _draws(logits, n, temperature=1.0, top_p=1.0, seed=22)
    _assert_frequencies(tokens, torch.softmax(logits.double(), 0), n)


@pytest.mark.parametrize("with_mask", [False, True])
def test_cpu_kernel_of_the_sample_op_draws_the_triton_tokens(with_mask):
    """``torch.ops.kvtier.sample`` on CPU (the torch inverse CDF) picks the Triton kernel's token for
    the same uniforms: greedy, temperature, top-p and the bitmask (distinct logits: no ties)."""
    from kvtier.ops.sampling import _sample_triton

    gen = torch.Generator().manual_seed(7)
    batch, vocab = 24, 300
    logits = torch.randn(batch, vocab, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7] * 6)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99, 0.2, 1.0] * 4)
    mask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    mask = mask if with_mask else None
    uniforms = torch.rand(batch, generator=gen)
    got = torch.ops.kvtier.sample(logits, temperature, top_p, uniforms, mask)
    want = _sample_triton(logits, temperature, top_p, uniforms, mask)
    assert torch.equal(got, want)


def test_per_row_generators_give_each_row_its_one_row_token():
    """A batch with per-row generators picks, row for row, the token of a one-row call with that
    row's generator (the engine's path before it sampled a step at once), on the kernel and on
    the torch inverse CDF alike."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 300, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 1.0, 0.9, 2.0])
    top_p = torch.tensor([1.0, 1.0, 0.8, 1.0, 1.0, 0.5, 0.95, 1.0])
    mask = torch.full((8, 10), -1, dtype=torch.int32)
    mask[[1, 4, 6]] = torch.stack([_pack_bitmask(list(range(r, 300, 4)), 300) for r in (0, 1, 2)])
    seeds = range(20, 28)
    gens = lambda: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    batched = ops.sample(logits, temperature, top_p, mask, generator=gens(), backend="triton")
    assert torch.equal(batched, ops.sample(logits, temperature, top_p, mask, generator=gens(), backend="torch"))
    for i, g in enumerate(gens()):
        row_mask = None if i not in (1, 4, 6) else mask[i:i + 1]
        alone = ops.sample(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], row_mask, g, backend="triton")
        assert batched[i] == alone[0], i
