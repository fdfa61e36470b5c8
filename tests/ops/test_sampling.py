"""``ops.sample``: greedy, temperature, top-p, the packed token bitmask and seeded reproducibility.

Statistical checks draw N i.i.d. samples in one call (a batch of N identical rows) from a seeded
generator, so they are deterministic; the bounds are still chosen so that a correct sampler
would pass for almost any seed (see ``_assert_frequencies``).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import ops, reference
from tests.helpers.sampling_checks import _assert_frequencies, _pack_bitmask


def _draws(logits_row, n, *, temperature=1.0, top_p=1.0, seed=0, bitmask_row=None):
    logits = logits_row[None, :].expand(n, -1).contiguous()
    mask = None if bitmask_row is None else bitmask_row[None, :].expand(n, -1).contiguous()
    gen = torch.Generator().manual_seed(seed)
    return ops.sample(logits, torch.full((n,), temperature), torch.full((n,), top_p), mask, gen)


LOGITS4 = torch.tensor([1.0, 0.2, -0.5, 0.7])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sample_frequencies_match_softmax_over_temperature(temperature):
    n = 20000
    tokens = _draws(LOGITS4, n, temperature=temperature, seed=int(temperature * 10))
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    _assert_frequencies(tokens, torch.softmax(LOGITS4.double() / temperature, dim=0), n)


def test_sample_top_p_keeps_smallest_prefix_reaching_p_and_renormalises():
    # probs 0.5, 0.3, 0.15, 0.05 (descending). top_p = 0.7: token 0 (mass before it 0) and token 1
    # (mass before 0.5 < 0.7) are kept; token 2 has 0.8 before it and is cut, as is token 3.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log().float()
    n = 20000
    tokens = _draws(logits, n, top_p=0.7, seed=3)
    assert set(tokens.unique().tolist()) == {0, 1}
    _assert_frequencies(tokens, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), n)


def test_sample_top_p_tiny_is_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=gen) * 3
    got = ops.sample(logits, torch.ones(64), torch.full((64,), 1e-6), generator=gen)
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_sample_temperature_zero_is_argmax(dtype):
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(33, 1001, generator=gen) * 4).to(dtype)
    temperature = torch.where(torch.arange(33) % 2 == 0, 0.0, 1.0)
    temperature[5] = -1.0  # "<= 0 means greedy"
    got = ops.sample(logits, temperature.float(), torch.full((33,), 0.9), generator=gen)
    greedy = temperature <= 0
    assert int(greedy.sum()) == 18
    assert torch.equal(got[greedy], logits.float().argmax(-1)[greedy])


def test_sample_bitmask_never_yields_disallowed_token():
    vocab = 100  # 4 words, the last one partial
    allowed = [3, 31, 32, 99]  # 31 is the sign bit of word 0; 99 in the partial word
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(vocab, generator=gen)
    logits[[0, 30, 50, 98]] = 20.0  # disallowed favourites: a mask that leaks would pick these
    n = 4000
    tokens = _draws(logits, n, temperature=1.0, seed=10, bitmask_row=_pack_bitmask(allowed, vocab))
    assert set(tokens.tolist()) <= set(allowed), f"disallowed tokens drawn: {set(tokens.tolist()) - set(allowed)}"
    # and the mask does not over-restrict: with comparable logits every allowed token shows up
    assert set(tokens.tolist()) == set(allowed)
    probs = torch.softmax(logits.double()[allowed], dim=0)
    _assert_frequencies(torch.tensor([allowed.index(t) for t in tokens.tolist()]), probs, n)


def test_sample_bitmask_greedy_picks_best_allowed():
    vocab = 70
    logits = torch.arange(vocab, dtype=torch.float32)[None].repeat(2, 1)  # token 69 is the argmax
    masks = torch.stack([_pack_bitmask([5, 40], vocab), _pack_bitmask([63, 64], vocab)])
    got = ops.sample(logits, torch.zeros(2), torch.ones(2), masks)
    assert got.tolist() == [40, 64]


def test_sample_seeded_generator_is_reproducible():
    logits = torch.randn(256, 50, generator=torch.Generator().manual_seed(0))
    temp, top_p = torch.full((256,), 1.3), torch.full((256,), 0.95)
    a = ops.sample(logits, temp, top_p, generator=torch.Generator().manual_seed(1234))
    b = ops.sample(logits, temp, top_p, generator=torch.Generator().manual_seed(1234))
    c = ops.sample(logits, temp, top_p, generator=torch.Generator().manual_seed(4321))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # 256 draws over ~50 tokens: identical by chance is ~impossible


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, math.nan])
def test_sample_rejects_top_p_outside_unit_interval(top_p):
    with pytest.raises(ValueError, match="top_p"):
        ops.sample(torch.randn(2, 8), torch.ones(2), torch.tensor([0.5, top_p]))


def test_sample_rejects_misshaped_arguments():
    with pytest.raises(ValueError, match="temperature"):
        ops.sample(torch.randn(2, 8), torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match="token_bitmask"):
        ops.sample(torch.randn(2, 40), torch.ones(2), torch.ones(2), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="token_bitmask"):
        ops.sample(torch.randn(2, 40), torch.ones(2), torch.ones(2), torch.zeros(2, 2, dtype=torch.int64))


def test_bitmask_row_allowing_nothing_is_a_clear_error():
    logits = torch.zeros(2, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1
    mask[1, 1] = 1 << 9  # bit for token 41: beyond the vocabulary, so row 1 allows nothing
    with pytest.raises(ValueError, match=r"token_bitmask allows no token in row\(s\) \[1\]"):
        ops.sample(logits, torch.zeros(2), torch.ones(2), token_bitmask=mask)


def test_greedy_rows_do_not_draw_from_the_generator():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    ops.sample(logits, torch.zeros(3), torch.ones(3), generator=g)
    assert torch.equal(g.get_state(), state)


def _generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_per_row_generators_frequencies_match_softmax_top_p_and_mask():
    """Row i drawn with its own generator seeded i: the first draws of 20000 seeds follow the same
    distribution the multinomial reference samples (softmax / T, top-p renormalised, masked)."""
    n = 20000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = (probs.log() * 1.5).float()  # at T = 1.5 the scaled probabilities are `probs`
    rows = logits[None].expand(n, -1).contiguous()
    tokens = ops.sample(rows, torch.full((n,), 1.5), torch.full((n,), 0.7), generator=_generators(range(n)))
    _assert_frequencies(tokens, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), n)
    allowed = [1, 2, 3]  # the mask drops token 0: the rest renormalised, top-p 1
    mask = _pack_bitmask(allowed, 4)[None].expand(n, -1).contiguous()
    tokens = ops.sample(rows, torch.full((n,), 1.5), torch.ones(n), mask, generator=_generators(range(n, 2 * n)))
    _assert_frequencies(tokens, torch.tensor([0.0, 0.6, 0.3, 0.1]), n)


def test_per_row_generators_give_a_row_the_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 200, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 1.0, 0.9, 2.0])
    top_p = torch.tensor([1.0, 1.0, 0.8, 1.0, 1.0, 0.5, 0.95, 1.0])
    mask = torch.full((8, 7), -1, dtype=torch.int32)
    mask[[1, 4, 6]] = torch.stack([_pack_bitmask(list(range(r, 200, 3)), 200) for r in (0, 1, 2)])
    batched = ops.sample(logits, temperature, top_p, mask, generator=_generators(range(10, 18)))
    for i in range(8):
        alone = ops.sample(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], mask[i:i + 1],
                           generator=_generators([10 + i]))
        assert batched[i] == alone[0], i
        u = torch.rand(1, generator=torch.Generator().manual_seed(10 + i)) if temperature[i] > 0 else torch.zeros(1)
        want = reference.sample_from_uniforms(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], u, mask[i:i + 1])
        assert batched[i] == want[0], i
    assert torch.equal(batched[[0, 4]], reference.sampling.apply_token_bitmask(logits, mask).argmax(-1)[[0, 4]])


def test_per_row_generators_advance_once_per_sampled_row_and_share_in_row_order():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    shared, own, greedy = (torch.Generator().manual_seed(s) for s in (1, 2, 3))
    state = greedy.get_state()
    ops.sample(logits, torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(4), generator=[shared, greedy, own, shared])
    assert torch.equal(greedy.get_state(), state)  # a greedy row draws nothing
    replay_shared, replay_own = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    torch.rand(2, generator=replay_shared)
    torch.rand(1, generator=replay_own)
    assert torch.equal(shared.get_state(), replay_shared.get_state())
    assert torch.equal(own.get_state(), replay_own.get_state())


def test_per_row_generators_are_checked():
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"generator: expected 2 per-row generators"):
        ops.sample(logits, torch.ones(2), torch.ones(2), generator=[torch.Generator()])
    with pytest.raises(ValueError, match=r"generator\[1\] must be a torch.Generator or None"):
        ops.sample(logits, torch.ones(2), torch.ones(2), generator=[torch.Generator(), 5])
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        ops.sample(logits, torch.ones(2), torch.ones(2), generator=5)


@pytest.mark.parametrize("temperature", [[0.0, 0.0, 0.0], [0.0, 0.8, 0.0], [1.2, 0.8, 0.5]])
def test_per_row_reference_equals_inverse_cdf_on_the_whole_batch(temperature):
    """The per-row path skips the vocabulary sort for greedy rows: its tokens equal
    sample_from_uniforms over the whole batch with the same uniforms, masked or not."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(5)) * 4
    logits[1, 7] = logits[1].max()  # a tie for the argmax
    temperature = torch.tensor(temperature)
    top_p = torch.tensor([0.9, 1.0, 0.6])
    mask = torch.full((3, 10), -1, dtype=torch.int32)
    mask[2] = _pack_bitmask(list(range(0, 300, 7)), 300)
    for token_bitmask in (None, mask):
        uniforms = reference.sampling.row_uniforms(temperature, _generators([1, 2, 3]), logits.device)
        want = reference.sample_from_uniforms(logits, temperature, top_p, uniforms, token_bitmask)
        got = reference.sample(logits, temperature, top_p, token_bitmask, generator=_generators([1, 2, 3]))
        assert torch.equal(got, want)
