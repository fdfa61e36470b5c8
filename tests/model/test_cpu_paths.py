"""K2's CPU paths in bf16 (oneDNN-packed dense projections, fp32 absorption products for a few
tokens, the experts' fp32 copies for the CPU MoE kernel) against the same model on its plain
paths (``F.linear``, bf16 ``einsum``, bf16 expert weights upcast per call), and the derived
copies follow the weights they come from."""

from __future__ import annotations

import pytest
import torch

from kvtier.model import KimiK2ForCausalLM, kimi_k2, preset
from kvtier.ops import _cpu_linear
from tests.helpers.step_inputs import one_prefill
from tests.ops._compare import assert_close


def _model(seed: int = 0) -> KimiK2ForCausalLM:
    torch.manual_seed(seed)
    model = KimiK2ForCausalLM(preset("tiny"), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _prefill(model, n: int):
    """n tokens of one sequence in a shuffled bf16 page pool whose unused rows are NaN."""
    return one_prefill(model, n, dtype=torch.bfloat16, fill=float("nan"), first_id=3)


def _plain(monkeypatch) -> None:
    monkeypatch.setattr(kimi_k2._cpu_linear, "pack_weight", lambda w: None)
    monkeypatch.setattr(kimi_k2, "ABSORB_FP32_MAX_TOKENS", 0)


@pytest.mark.skipif(not _cpu_linear.available(), reason="this torch lacks oneDNN's prepacked linear")
@pytest.mark.parametrize("num_tokens", [5, 40])  # fp32 absorption (<= 32 tokens) and bf16 einsum
def test_bf16_cpu_paths_match_the_plain_paths(monkeypatch, num_tokens):
    model = _model()
    ids, pos, batch, caches = _prefill(model, num_tokens)
    fast = model(ids, pos, batch, caches)
    assert bool(torch.isfinite(fast).all())
    packed = model.layers[0].self_attn.derived._held
    assert packed and all(v is not None for _, v in packed.values()), "the dense projections were not packed"
    with monkeypatch.context() as m:
        _plain(m)
        fresh = _model()
        ids, pos, batch, caches = _prefill(fresh, num_tokens)
        plain = fresh(ids, pos, batch, caches)
    # same GEMM kernel for the projections; the absorption rounds once either way (fp32 accumulation)
    assert_close(fast, plain, atol=2e-2, rtol=2e-2, max_cos_diff=1e-4, name="hidden")


def test_packed_linear_is_f_linear_bit_for_bit():
    if not _cpu_linear.available():
        pytest.skip("this torch lacks oneDNN's prepacked linear")
    gen = torch.Generator().manual_seed(3)
    for rows, n, k in [(1, 17, 33), (8, 576, 256), (97, 130, 54), (0, 12, 8)]:
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        assert torch.equal(_cpu_linear.linear(x, _cpu_linear.pack_weight(w)), torch.nn.functional.linear(x, w))
    assert _cpu_linear.pack_weight(torch.randn(4, 4)) is None  # fp32: F.linear runs


def test_derived_copies_follow_in_place_writes_and_new_storage():
    held = _cpu_linear.DerivedWeights()
    w = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16), requires_grad=False)
    first = held.get("w32", w, lambda t: t.float())
    assert held.get("w32", w, lambda t: t.float()) is first
    with torch.no_grad():
        w.copy_(torch.full((2, 2), 3.0))  # what the loader does
    assert bool((held.get("w32", w, lambda t: t.float()) == 3.0).all())
    w.data = torch.full((2, 2), 5.0, dtype=torch.bfloat16)  # another storage
    assert bool((held.get("w32", w, lambda t: t.float()) == 5.0).all())


def test_a_reloaded_model_runs_on_its_new_weights(monkeypatch):
    """Weights written in place after a forward (a reload) reach the next forward."""
    model, other = _model(0), _model(1)
    ids, pos, batch, caches = _prefill(model, 5)
    model(ids, pos, batch, caches)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)
    ids, pos, batch, caches = _prefill(model, 5)
    got = model(ids, pos, batch, caches)
    ids, pos, batch, caches = _prefill(other, 5)
    assert torch.equal(got, other(ids, pos, batch, caches))


def test_a_model_built_under_inference_mode_runs_its_cpu_paths():
    """Weights made under ``torch.inference_mode`` carry no version counter; the derived copies
    are then keyed by storage alone."""
    with torch.inference_mode():
        model = _model(2)
        ids, pos, batch, caches = _prefill(model, 5)
        first = model(ids, pos, batch, caches)
        ids, pos, batch, caches = _prefill(model, 5)
        assert torch.equal(model(ids, pos, batch, caches), first)
