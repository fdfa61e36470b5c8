"""The CPU LM head for a few rows (``few_rows_linear``) equals ``x @ weight.T`` computed in
float64, for every row count it is taken for, a vocabulary that is not a multiple of its chunk,
and non-contiguous input rows; ``compute_logits`` takes it for few rows only, and matches the product either way."""

from __future__ import annotations

import pytest
import torch

import kvtier.model.kimi_k2 as kimi_k2
from kvtier.llm import _random_model
from kvtier.model.kimi_k2 import FEW_ROWS, few_rows_linear
from tests.ops._compare import assert_close

FP32 = {"atol": 1e-5, "rtol": 1e-5}


def _reference(x, weight):
    return (x.double() @ weight.double().T).float()


@pytest.mark.parametrize("n", [1, 2, 3, 8, FEW_ROWS, FEW_ROWS + 5])
@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_few_rows_linear_matches_the_float64_product(n, chunk, monkeypatch):
    monkeypatch.setattr(kimi_k2, "VOCAB_CHUNK", chunk)
    gen = torch.Generator().manual_seed(n * 31 + chunk)
    weight = torch.randn(101, 24, generator=gen)  # 101 rows: a last chunk of another size
    x = torch.randn(n, 2 * 24, generator=gen)[:, ::2]  # not contiguous (strided columns)
    got = few_rows_linear(x, weight)
    assert got.shape == (n, 101) and got.is_contiguous() and got.dtype == torch.float32
    assert_close(got, _reference(x, weight), name="few_rows_linear", **FP32)


@pytest.mark.parametrize("x_shape,w_shape,match", [((0, 8), (10, 8), "n >= 1"), ((2, 8), (10, 9), r"weight \[V, K\]"),
                                                   ((8,), (10, 8), "x"), ((2, 8), (10, 8, 1), "weight")])
def test_few_rows_linear_rejects_bad_shapes(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        few_rows_linear(torch.zeros(x_shape), torch.zeros(w_shape))


def test_few_rows_linear_rejects_mixed_dtypes():
    with pytest.raises(ValueError, match="dtype and device"):
        few_rows_linear(torch.zeros(2, 8), torch.zeros(10, 8, dtype=torch.float64))


@pytest.mark.parametrize("n", [0, 1, 5, FEW_ROWS, FEW_ROWS + 1])
def test_compute_logits_takes_it_for_few_rows_only_and_matches_the_float64_product(n, monkeypatch):
    model = _random_model("tiny", seed=3, dtype=torch.float32, device="cpu")
    calls = []
    monkeypatch.setattr(kimi_k2, "few_rows_linear", lambda x, w: calls.append(x.shape[0]) or few_rows_linear(x, w))
    hidden = torch.randn(n, model.config.hidden_size, generator=torch.Generator().manual_seed(n))
    with torch.inference_mode():
        got = model.compute_logits(hidden)
    assert calls == ([n] if 0 < n <= FEW_ROWS else [])
    assert got.shape == (n, model.config.vocab_size) and got.dtype == torch.float32
    assert_close(got, _reference(hidden, model.lm_head.detach()), name="compute_logits", **FP32)


@pytest.mark.parametrize("n", [1, 2, 8, FEW_ROWS + 1])
def test_compute_logits_in_bf16_matches_f_linear(n):
    """bf16 rows (2 to FEW_ROWS of them take ``lm_head @ hidden.T``) give fp32 logits within
    bf16 rounding of ``F.linear``'s and of the float64 product."""
    model = _random_model("tiny", seed=4, dtype=torch.bfloat16, device="cpu")
    hidden = torch.randn(n, model.config.hidden_size, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    with torch.inference_mode():
        got = model.compute_logits(hidden)
        want = torch.nn.functional.linear(hidden, model.lm_head).float()
    assert got.shape == (n, model.config.vocab_size) and got.dtype == torch.float32 and got.is_contiguous()
    scale = float(want.abs().max())
    assert_close(got, want, atol=1e-2 * scale, rtol=1e-2, name="compute_logits bf16 vs F.linear")
    assert_close(got, _reference(hidden, model.lm_head.detach()), atol=1e-2 * scale, rtol=1e-2, name="vs float64")
