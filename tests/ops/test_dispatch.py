"""Backend dispatch: every public op takes ``backend=`` and refuses what this build cannot run."""

from __future__ import annotations

import pytest
import torch

from kvtier import ops
from kvtier.ops import dispatch


def _written(cache, write):
    """Run an in-place op and return what it wrote (so backends can be compared)."""
    assert write(cache) is None
    return cache


def _calls():
    """One small valid call per public op, as ``backend -> result``."""
    q = torch.randn(2, 3, 24)
    kv = torch.randn(4, 4, 24)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    cache = torch.tensor([[0.5, -0.5, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]]).repeat(4, 1)
    packed, scale = torch.zeros(3, 6, 4, dtype=torch.int32), torch.ones(3, 6, 1)  # INT4 [E=3, 6, K=32], group 32
    fp8, scale_inv = torch.ones(3, 6, 32).to(torch.float8_e4m3fn), torch.ones(3, 1, 1)
    w2p, w2s = torch.zeros(3, 32, 1, dtype=torch.int32), torch.ones(3, 32, 1)  # MoE: H = 32, I = 8, group 8
    moe_x, moe_w, moe_ids = torch.randn(2, 32), torch.ones(2, 1), torch.tensor([[0], [2]], dtype=torch.int32)
    w13p, w13s = torch.zeros(3, 16, 4, dtype=torch.int32), torch.ones(3, 16, 4)
    w13f, s13f = torch.ones(3, 16, 32).to(torch.float8_e4m3fn), torch.ones(3, 1, 1)
    w2f, s2f = torch.ones(3, 32, 8).to(torch.float8_e4m3fn), torch.ones(3, 1, 1)
    kq, kv_, kg, kb = torch.randn(3, 2, 4), torch.randn(3, 2, 5), -torch.rand(3, 2, 4), torch.rand(3, 2)  # KDA, H=2
    cu3, i32 = torch.tensor([0, 1, 3], dtype=torch.int32), torch.int32
    u8 = torch.uint8  # MXFP4: w13 [3, 2 * 32, 32 // 2], w2 [3, 32, 32 // 2], E8M0 scales near 1
    mx_w13, mx_s13 = torch.randint(0, 256, (3, 64, 16)).to(u8), torch.randint(126, 129, (3, 64, 1)).to(u8)
    mx_w2, mx_s2 = torch.randint(0, 256, (3, 32, 16)).to(u8), torch.randint(126, 129, (3, 32, 1)).to(u8)
    return {
        "mla_decode": lambda b: ops.mla_decode(q, kv, bt, lens, 0.2, 16, backend=b),
        "mla_extend": lambda b: ops.mla_extend(q, kv, bt, torch.tensor([0, 1, 2], dtype=torch.int32), lens, 0.2, 16,
                                               backend=b),
        "concat_and_cache_mla": lambda b: _written(kv.clone(), lambda c: ops.concat_and_cache_mla(
            torch.ones(2, 16), torch.ones(2, 8), c, torch.tensor([0, 5]), backend=b)),
        "moe_route": lambda b: ops.moe_route(torch.randn(3, 16), torch.zeros(16), 2, 4, 2, 1.0, backend=b),
        "fused_moe": lambda b: ops.fused_moe(torch.randn(2, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3),
                                             torch.ones(2, 1), torch.tensor([[0], [3]], dtype=torch.int32), backend=b),
        "moe_align_block_size": lambda b: ops.moe_align_block_size(torch.tensor([[2, 0], [3, 2]], dtype=torch.int32),
                                                                   4, 2, backend=b),
        "gather_pages": lambda b: ops.gather_pages([kv, kv], torch.tensor([2, 0]), backend=b),
        "scatter_pages": lambda b: _written([kv.clone()], lambda pools: ops.scatter_pages(
            torch.ones(1, 1, 4, 24), pools, torch.tensor([3]), backend=b))[0],
        "sample": lambda b: ops.sample(torch.randn(2, 8), torch.zeros(2), torch.ones(2), backend=b),
        "rms_norm": lambda b: ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, backend=b),
        "silu_and_mul": lambda b: ops.silu_and_mul(torch.randn(2, 8), backend=b),
        "rope_interleaved": lambda b: ops.rope_interleaved(torch.randn(2, 4), torch.tensor([0, 7]), cache, backend=b),
        "dequantize_int4_group": lambda b: ops.dequantize_int4_group(packed, scale, backend=b),
        "dequantize_fp8_block": lambda b: ops.dequantize_fp8_block(fp8, scale_inv, backend=b),
        "linear_w4a16": lambda b: ops.linear_w4a16(torch.randn(2, 32), packed[0], scale[0], backend=b),
        "linear_fp8_block": lambda b: ops.linear_fp8_block(torch.randn(2, 32), fp8[0], scale_inv[0], backend=b),
        "fused_moe_w4a16": lambda b: ops.fused_moe_w4a16(moe_x, w13p, w13s, w2p, w2s, moe_w, moe_ids, 8, backend=b),
        "fused_moe_fp8_block": lambda b: ops.fused_moe_fp8_block(moe_x, w13f, s13f, w2f, s2f, moe_w, moe_ids,
                                                                 backend=b),
        "dequantize_mxfp4": lambda b: ops.dequantize_mxfp4(mx_w13, mx_s13, backend=b),
        "linear_mxfp4": lambda b: ops.linear_mxfp4(torch.randn(2, 32), mx_w13[0], mx_s13[0], backend=b),
        "fused_moe_mxfp4": lambda b: ops.fused_moe_mxfp4(moe_x, mx_w13, mx_s13, mx_w2, mx_s2, moe_w, moe_ids,
                                                         activation="situ", situ_beta=4.0, backend=b),
        "kda_chunk_prefill": lambda b: ops.kda_chunk_prefill(kq, kq, kv_, kg, kb, torch.ones(2, 2, 4, 5), cu3,
                                                             backend=b),
        "kda_recurrent_decode": lambda b: _with_state(torch.ones(3, 2, 4, 5), lambda s: ops.kda_recurrent_decode(
            kq, kq, kv_, kg, kb, s, torch.tensor([2, -1, 0], dtype=i32), backend=b)),
        "causal_conv1d_prefill": lambda b: ops.causal_conv1d_prefill(kq[:, 0], torch.ones(4, 3), None, None, cu3,
                                                                     backend=b),
        "causal_conv1d_update": lambda b: _with_state(torch.ones(2, 4, 2), lambda s: ops.causal_conv1d_update(
            kq[:, 0], torch.ones(4, 3), None, s, torch.tensor([1, -1, 0], dtype=i32), backend=b)),
    }


def _with_state(state, step):
    """Run an op that also updates ``state`` in place; return (its output, the state)."""
    return step(state), state


OPS = sorted(_calls())


def test_every_public_op_is_covered():
    public = {name for name in ops.__all__ if callable(getattr(ops, name)) and name[0].islower()}
    helpers = {n for n in public if n.startswith(("check_", "plan_")) or n.endswith("_run")}  # checks, plan/run
    assert helpers == {"check_expert_ids", "check_positions", "check_slot_mapping", "plan_mla_decode",
                       "plan_mla_extend", "mla_decode_run", "mla_extend_run"}
    dtype_tools = {"fp8_e4m3_dtype", "fp8_e4m3fn_to_fnuz"}  # fp8 dtype per arch and its conversion: no kernel
    assert public - helpers - dtype_tools - {"is_backend_supported", "resolve_backend"} == set(OPS)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["triton", "hip", "aiter"])
def test_unbuilt_backend_raises_backend_unavailable(op, backend, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors: triton only under the interpreter
    with pytest.raises(ops.BackendUnavailableError, match=backend):
        _calls()[op](backend)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["cuda", "Torch", ""])
def test_unknown_backend_raises_value_error(op, backend):
    with pytest.raises(ValueError, match="backend"):
        _calls()[op](backend)


def _same(a, b):
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


@pytest.mark.parametrize("op", OPS)
def test_auto_and_torch_agree(op):
    call = _calls()[op]
    torch.manual_seed(0)
    auto = call("auto")
    torch.manual_seed(0)
    explicit = call("torch")
    assert _same(auto, explicit)


def test_resolve_backend_is_pure_and_explicit(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ops.resolve_backend("mla_decode", "auto", "cpu", torch.bfloat16) == "torch"
    assert ops.resolve_backend("mla_decode", "torch", "cpu", torch.float32) == "torch"
    assert ops.is_backend_supported("mla_decode", "torch")
    assert not ops.is_backend_supported("mla_decode", "triton")
    assert set(ops.BACKENDS) == {"auto", "torch", "triton", "hip", "aiter"}
    assert issubclass(ops.BackendUnavailableError, RuntimeError)


# ---------------------------------------------------------------------------------------------
# the per-op registry and the availability reasons

triton_installed = pytest.mark.skipif(not dispatch._has_module("triton"), reason="triton not installed")


def test_registry_records_implemented_backends():
    assert "triton" in dispatch.implemented_backends("mla_decode")
    assert dispatch.implemented_backends("an_op_nobody_registered") == {"torch"}
    dispatch.register_backend("_test_only_op", "triton")
    assert dispatch.implemented_backends("_test_only_op") == {"torch", "triton"}
    with pytest.raises(ValueError, match="backend"):
        dispatch.register_backend("_test_only_op", "auto")


def test_unimplemented_backend_names_the_op_and_what_exists():
    reason = dispatch.unavailable_reason("an_op_nobody_registered", "triton", "cuda")
    assert "no 'triton' implementation" in reason and "torch" in reason
    with pytest.raises(ops.BackendUnavailableError, match="no 'triton' implementation"):
        ops.resolve_backend("an_op_nobody_registered", "triton", "cuda", torch.bfloat16)


@pytest.mark.skipif(torch.version.hip is not None, reason="ROCm build")
def test_aiter_reports_it_needs_rocm():
    dispatch.register_backend("_test_aiter_op", "aiter")
    with pytest.raises(ops.BackendUnavailableError, match="aiter needs ROCm"):
        ops.resolve_backend("_test_aiter_op", "aiter", "cuda", torch.bfloat16)


def test_hip_reports_it_is_not_built():
    dispatch.register_backend("_test_hip_op", "hip")
    assert {"mla_decode", "gather_pages", "scatter_pages", "moe_align_block_size"} <= {
        op for op in OPS + ["moe_align_block_size"] if "hip" in dispatch.implemented_backends(op)}
    if not dispatch._has_module("kvtier._hip"):
        reason = dispatch.unavailable_reason("_test_hip_op", "hip", "cuda")
        assert "not built" in reason and "KVTIER_BUILD_HIP" in reason
    else:
        assert "GPU tensor" in dispatch.unavailable_reason("_test_hip_op", "hip", "cpu")


@triton_installed
def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ops.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        ops.resolve_backend("mla_decode", "triton", "cpu", torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if dispatch._interpreter_unready() is None:  # the interpreter was on when triton was imported
        assert ops.resolve_backend("mla_decode", "triton", "cpu", torch.float32) == "triton"
    # auto never picks the interpreter
    assert ops.resolve_backend("mla_decode", "auto", "cpu", torch.float32) == "torch"


@triton_installed
def test_auto_picks_triton_on_a_gpu_where_implemented():
    # pure: no GPU needed to ask what auto means for a CUDA/HIP tensor
    assert ops.resolve_backend("mla_decode", "auto", "cuda", torch.bfloat16) == "triton"
    assert ops.resolve_backend("mla_extend", "auto", "cuda:1", torch.float16) == "triton"
    assert ops.resolve_backend("an_op_nobody_registered", "auto", "cuda", torch.bfloat16) == "torch"


def test_triton_not_installed_is_the_reason(monkeypatch):
    monkeypatch.setattr(dispatch, "_has_module", lambda name: False)
    assert dispatch.unavailable_reason("mla_decode", "triton", "cuda") == "triton not installed"
    assert ops.resolve_backend("mla_decode", "auto", "cuda", torch.bfloat16) == "torch"
