"""Plan once per step, run once per layer: the planned ops equal the one-call ops, runs with a plan
made for other shapes fail on the host with the argument named, plans check the lengths once.

Inputs are the adversarial paged inputs of ``test_mla.py`` (shuffled NaN-poisoned pages, sentinels
past each sequence's pages, zero-length sequences, a non-contiguous cache).
"""

from __future__ import annotations

import pytest
import torch

from kvtier import ops
from kvtier.ops import dispatch
from tests.helpers.mla_inputs import _paged_pool, _rounded

RANK, ROPE, HEADS, SM_SCALE = 16, 8, 5, 0.3
SEQ_LENS = [17, 0, 1, 33, 0]


def _backends():
    return ["torch"] + (["triton"] if dispatch.is_backend_supported("mla_decode", "triton", "cpu") else [])


def _inputs(page_size=4, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    seqs = [_rounded((n, RANK + ROPE), torch.float32, gen) for n in SEQ_LENS]
    kv, bt = _paged_pool(seqs, page_size, torch.float32, gen, strided=True)
    q = _rounded((len(SEQ_LENS), HEADS, RANK + ROPE), torch.float32, gen)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    return q.to(device), kv.to(device), bt.to(device), lens.to(device)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("max_seq_len", [None, 40])
def test_planned_decode_equals_one_call_for_every_layer(backend, max_seq_len):
    q, kv, bt, lens = _inputs()
    plan = ops.plan_mla_decode(bt, lens, 4, HEADS, RANK, max_seq_len=max_seq_len, backend=backend)
    assert plan.backend == backend and plan.max_seq_len == (max_seq_len or max(SEQ_LENS))
    want_out, want_lse = ops.mla_decode(q, kv, bt, lens, SM_SCALE, RANK, backend="torch")
    for layer in range(2):  # one plan, several layers (caches and queries of the same shapes)
        got_out, got_lse = ops.mla_decode_run(q * (layer + 1), kv, plan, SM_SCALE)
        ref_out, ref_lse = ops.mla_decode(q * (layer + 1), kv, bt, lens, SM_SCALE, RANK, backend="torch")
        torch.testing.assert_close(got_out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got_lse, ref_lse, atol=1e-4, rtol=0)
    assert bool((want_out[1] == 0).all()) and bool(torch.isinf(want_lse[1]).all())


@pytest.mark.parametrize("backend", _backends())
def test_planned_extend_equals_one_call(backend):
    q, kv, bt, lens = _inputs(page_size=1)
    cu = torch.tensor([0, 4, 4, 5, 7, 7], dtype=torch.int32)
    q = q.repeat(2, 1, 1)[:7]
    plan = ops.plan_mla_extend(bt, cu, lens, 1, HEADS, RANK, backend=backend)
    assert (plan.total_q, plan.max_new_tokens) == (7, 4)
    got_out, got_lse = ops.mla_extend_run(q, kv, plan, SM_SCALE)
    want_out, want_lse = ops.mla_extend(q, kv, bt, cu, lens, SM_SCALE, RANK, backend="torch")
    torch.testing.assert_close(got_out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=0)


def test_decode_split_count_follows_the_planned_length():
    if not dispatch.is_backend_supported("mla_decode", "triton", "cpu"):
        pytest.skip("needs the Triton interpreter")
    _, _, bt, lens = _inputs()
    # one compute unit on CPU: ~2 programs wanted, capped by max_seq_len // 256
    assert ops.plan_mla_decode(bt, lens, 4, 1, RANK, backend="triton").num_splits == 1
    assert ops.plan_mla_decode(bt, lens, 4, HEADS, RANK, backend="torch").num_splits == 0


def _run_error(**change):
    q, kv, bt, lens = _inputs()
    plan = ops.plan_mla_decode(bt, lens, 4, HEADS, RANK, num_pages=kv.shape[0])
    args = {"q": q, "kv_cache": kv, "plan": plan, "sm_scale": SM_SCALE, **change}
    with pytest.raises(ValueError) as info:
        ops.mla_decode_run(**args)
    return str(info.value)


def test_run_with_a_plan_for_other_shapes_names_the_argument():
    q, kv, _, _ = _inputs()
    assert _run_error(q=q[:3]).startswith("q must have shape (5, 5, 24), got (3, 5, 24)")
    assert _run_error(q=q[:, :2]).startswith("q must have shape (5, 5, 24)")
    num_pages = kv.shape[0]
    assert "page_size 4" in _run_error(kv_cache=torch.zeros(num_pages, 8, RANK + ROPE))
    assert f"num_pages {num_pages} pages" in _run_error(kv_cache=torch.zeros(num_pages - 1, 4, RANK + ROPE))
    assert _run_error(kv_cache=torch.zeros(num_pages, 4, RANK), q=torch.zeros(5, HEADS, RANK)).startswith(
        "kv_lora_rank must be in (0, 16)")
    assert _run_error(out=torch.empty(5, HEADS, RANK + 1)).startswith("out must have shape (5, 5, 16)")


def test_extend_run_with_other_token_count_names_q():
    q, kv, bt, lens = _inputs()
    plan = ops.plan_mla_extend(bt, torch.tensor([0, 1, 1, 2, 3, 3], dtype=torch.int32), lens, 4, HEADS, RANK)
    with pytest.raises(ValueError, match=r"^q must have shape \(3, 5, 24\), got \(5, 5, 24\)"):
        ops.mla_extend_run(q, kv, plan, SM_SCALE)


def test_plan_checks_lengths_once():
    _, _, bt, lens = _inputs()
    with pytest.raises(ValueError, match="seq_lens max 33 exceeds block_table capacity"):
        ops.plan_mla_decode(bt, lens, 2, HEADS, RANK)
    with pytest.raises(ValueError, match="seq_lens must be >= 0, got min -3"):
        ops.plan_mla_decode(bt, torch.tensor([1, -3, 0, 0, 0], dtype=torch.int32), 4, HEADS, RANK)
    with pytest.raises(ValueError, match=r"max_seq_len must be an int in \[seq_lens max 33, "):
        ops.plan_mla_decode(bt, lens, 4, HEADS, RANK, max_seq_len=20)
    top = max(int(bt[b, :-(-n // 4)].max()) for b, n in enumerate(SEQ_LENS) if n)  # the read ids; sentinels are not
    with pytest.raises(ValueError, match=rf"block_table has 1 page id\(s\) outside \[0, num_pages={top}\)"):
        ops.plan_mla_decode(bt, lens, 4, HEADS, RANK, num_pages=top)
    assert ops.plan_mla_decode(bt, lens, 4, HEADS, RANK, num_pages=top + 1).num_pages == top + 1
    with pytest.raises(ValueError, match="num_heads must be an int >= 1, got 0"):
        ops.plan_mla_decode(bt, lens, 4, 0, RANK)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        ops.plan_mla_extend(bt, torch.tensor([0, 2, 1, 1, 1, 1], dtype=torch.int32), lens, 4, HEADS, RANK)


def test_run_reads_no_device_value_on_the_host(monkeypatch):
    q, kv, bt, lens = _inputs()
    plan = ops.plan_mla_decode(bt, lens, 4, HEADS, RANK)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read of a device value in run")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    # the torch reference kernel itself reads lengths (it is the CPU kernel; GPUs run Triton), so
    # the op is replaced by its fake: what remains is the run's own Python
    monkeypatch.setattr(ops.attention, "device_backend", lambda op, device: "torch")
    monkeypatch.setattr(torch.ops.kvtier, "mla_decode", lambda q, *a: q.new_empty(q.shape[:2]))
    monkeypatch.setattr(ops.attention._mla_library, "decode_cpu", lambda q, *a: q.new_empty(q.shape[:2]))
    out, lse = ops.mla_decode_run(q, kv, plan, SM_SCALE)
    assert out.shape == (5, HEADS, RANK) and lse.shape == (5, HEADS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("backend", ["auto", "triton", "hip"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_planned_decode_equals_unplanned(backend, page_size):
    if not dispatch.is_backend_supported("mla_decode", "triton" if backend == "auto" else backend, "cuda"):
        pytest.skip(f"{backend} is not available here")
    q, kv, bt, lens = _inputs(page_size=page_size, device="cuda")
    q, kv = q.bfloat16(), kv.bfloat16()
    want_out, want_lse = ops.mla_decode(q, kv, bt, lens, SM_SCALE, RANK, backend=backend)
    for bound in (None, bt.shape[1] * page_size):
        plan = ops.plan_mla_decode(bt, lens, page_size, HEADS, RANK, max_seq_len=bound, backend=backend)
        got_out, got_lse = ops.mla_decode_run(q, kv, plan, SM_SCALE)
        torch.testing.assert_close(got_out.float(), want_out.float(), atol=1e-2, rtol=1.6e-2)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-3, rtol=0)
        torch.cuda.synchronize()
