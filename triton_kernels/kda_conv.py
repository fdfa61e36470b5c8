"""Causal short convolution of the KDA layers (depthwise, kernel ``WIDTH``, 4 in K3): prefill and update.

``y[t, d] = act(bias[d] + sum_j weight[d, j] * x[t - WIDTH + 1 + j, d])``; inputs before a
sequence's first new token come from its conv state ``[*, dim, WIDTH - 1]`` (oldest first). fp32
accumulation; x/weight/bias in their dtype (fp32/bf16/fp16); SiLU when ``SILU``.

Layouts: x ``[tokens, dim]`` with contiguous dim and any token stride (x may be a view of a wider
projection); weight ``[dim, WIDTH]``, bias ``[dim]``, states ``[*, dim, WIDTH - 1]``, y
``[tokens, dim]``: contiguous. Bytes and FLOPs: see :mod:`kvtier.reference.kda`.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, register_kernel


@triton.jit
def _finish(acc, bias_ptr, offs_d, mask_d, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def conv_prefill_kernel(x_ptr, weight_ptr, bias_ptr, state_ptr, y_ptr, cu_seqlens_ptr, seq_ids_ptr, num_tokens,
                        dim, stride_x_t, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
                        WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid ``(cdiv(tokens, BLOCK_T), cdiv(dim, BLOCK_D))``. seq_ids_ptr: [tokens] int32, the
    sequence of each packed token; state_ptr: [batch, dim, WIDTH - 1] (read when HAS_STATE, else
    zeros before each sequence)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < num_tokens
    mask_d = offs_d < dim
    seq = tl.load(seq_ids_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    bos = tl.load(cu_seqlens_ptr + seq, mask=mask_t, other=0)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        src = offs_t - (WIDTH - 1) + j
        from_x = (src >= bos) & mask_t
        w = tl.load(weight_ptr + offs_d * WIDTH + j, mask=mask_d, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x_t + offs_d[None, :],
                     mask=from_x[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        if HAS_STATE:
            from_state = (src < bos) & mask_t
            col = (WIDTH - 1) + src - bos
            sv = tl.load(state_ptr + (seq[:, None] * dim + offs_d[None, :]) * (WIDTH - 1) + col[:, None],
                         mask=from_state[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
            xv += sv
        acc += xv * w[None, :]
    acc = _finish(acc, bias_ptr, offs_d[None, :], mask_d[None, :], HAS_BIAS, SILU)
    tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * dim + offs_d[None, :], acc,
             mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def conv_final_state_kernel(x_ptr, state_ptr, final_ptr, cu_seqlens_ptr, dim, stride_x_t,
                            HAS_STATE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    """Grid ``(batch, cdiv(dim, BLOCK_D))``: final[b] = the last WIDTH - 1 inputs of sequence b
    (from its old state where it has fewer new tokens). final_ptr: [batch, dim, WIDTH - 1]."""
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    bos = tl.load(cu_seqlens_ptr + b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + b + 1).to(tl.int64)
    c = tl.arange(0, BLOCK_W)
    mask_c = c < WIDTH - 1
    pos = eos - (WIDTH - 1) + c
    from_x = (pos >= bos) & mask_c
    vals = tl.load(x_ptr + pos[None, :] * stride_x_t + offs_d[:, None], mask=mask_d[:, None] & from_x[None, :],
                   other=0.0).to(tl.float32)
    row = (b.to(tl.int64) * dim + offs_d[:, None]) * (WIDTH - 1)
    if HAS_STATE:
        from_state = (pos < bos) & mask_c
        old = tl.load(state_ptr + row + (c + (eos - bos))[None, :], mask=mask_d[:, None] & from_state[None, :],
                      other=0.0).to(tl.float32)
        vals += old
    tl.store(final_ptr + row + c[None, :], vals, mask=mask_d[:, None] & mask_c[None, :])


@triton.jit
def conv_update_kernel(x_ptr, weight_ptr, bias_ptr, state_ptr, state_indices_ptr, y_ptr, dim, stride_x_b,
                       HAS_BIAS: tl.constexpr, SILU: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """Grid ``(batch, cdiv(dim, BLOCK_D))``: one new input of sequence b through its slot's window,
    which shifts by one in place; a negative ``state_indices[b]`` writes zeros to y only.
    state_ptr: [num_slots, dim, WIDTH - 1]; y_ptr: [batch, dim]."""
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    y_out = y_ptr + b.to(tl.int64) * dim + offs_d
    slot = tl.load(state_indices_ptr + b).to(tl.int64)
    if slot < 0:
        tl.store(y_out, tl.zeros([BLOCK_D], dtype=tl.float32), mask=mask_d)
    else:
        c = tl.arange(0, BLOCK_W)
        row = state_ptr + (slot * dim + offs_d[:, None]) * (WIDTH - 1)
        window = tl.load(row + c[None, :], mask=mask_d[:, None] & (c < WIDTH - 1)[None, :], other=0.0)
        xv = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + offs_d, mask=mask_d, other=0.0)
        window = tl.where((c == WIDTH - 1)[None, :], xv.to(tl.float32)[:, None], window.to(tl.float32))
        w = tl.load(weight_ptr + offs_d[:, None] * WIDTH + c[None, :], mask=mask_d[:, None] & (c < WIDTH)[None, :],
                    other=0.0).to(tl.float32)
        acc = _finish(tl.sum(window * w, axis=1), bias_ptr, offs_d, mask_d, HAS_BIAS, SILU)
        tl.store(y_out, acc, mask=mask_d)
        tl.store(row + (c - 1)[None, :], window, mask=mask_d[:, None] & ((c >= 1) & (c < WIDTH))[None, :])


# K3: q, k, v projections of 96 heads x 128 convolved together (dim = 3 * 12,288 = 36,864),
# kernel 4, bf16 activations and weights, bf16 conv states.
K3_CONV_DIM, K3_CONV_WIDTH = 3 * 96 * 128, 4
CONV_BLOCK_T, CONV_BLOCK_D, CONV_NUM_WARPS = 16, 128, 4


def _prefill_cases(arch: str) -> list[CompileCase]:
    sig = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16", "state_ptr": "*bf16", "y_ptr": "*bf16",
           "cu_seqlens_ptr": "*i32", "seq_ids_ptr": "*i32", "num_tokens": "i32", "dim": "i32", "stride_x_t": "i32",
           "HAS_BIAS": "constexpr", "HAS_STATE": "constexpr", "SILU": "constexpr", "WIDTH": "constexpr",
           "BLOCK_T": "constexpr", "BLOCK_D": "constexpr"}
    consts = {"HAS_BIAS": False, "HAS_STATE": True, "SILU": True, "WIDTH": K3_CONV_WIDTH, "BLOCK_T": CONV_BLOCK_T,
              "BLOCK_D": CONV_BLOCK_D}
    values = {"dim": K3_CONV_DIM, "stride_x_t": K3_CONV_DIM}
    return [CompileCase("k3-d36864-w4-bf16", sig, consts, CONV_NUM_WARPS, 1, values=values)]


def _final_state_cases(arch: str) -> list[CompileCase]:
    sig = {"x_ptr": "*bf16", "state_ptr": "*bf16", "final_ptr": "*bf16", "cu_seqlens_ptr": "*i32", "dim": "i32",
           "stride_x_t": "i32", "HAS_STATE": "constexpr", "WIDTH": "constexpr", "BLOCK_W": "constexpr",
           "BLOCK_D": "constexpr"}
    consts = {"HAS_STATE": True, "WIDTH": K3_CONV_WIDTH, "BLOCK_W": 4, "BLOCK_D": CONV_BLOCK_D}
    values = {"dim": K3_CONV_DIM, "stride_x_t": K3_CONV_DIM}
    return [CompileCase("k3-d36864-w4-bf16", sig, consts, CONV_NUM_WARPS, 1, values=values)]


def _update_cases(arch: str) -> list[CompileCase]:
    sig = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16", "state_ptr": "*bf16",
           "state_indices_ptr": "*i32", "y_ptr": "*bf16", "dim": "i32", "stride_x_b": "i32", "HAS_BIAS": "constexpr",
           "SILU": "constexpr", "WIDTH": "constexpr", "BLOCK_W": "constexpr", "BLOCK_D": "constexpr"}
    consts = {"HAS_BIAS": False, "SILU": True, "WIDTH": K3_CONV_WIDTH, "BLOCK_W": 4, "BLOCK_D": CONV_BLOCK_D}
    values = {"dim": K3_CONV_DIM, "stride_x_b": K3_CONV_DIM}
    return [CompileCase("k3-d36864-w4-bf16", sig, consts, CONV_NUM_WARPS, 1, values=values)]


register_kernel("causal_conv1d_prefill", conv_prefill_kernel, _prefill_cases)
register_kernel("causal_conv1d_final_state", conv_final_state_kernel, _final_state_cases)
register_kernel("causal_conv1d_update", conv_update_kernel, _update_cases)
