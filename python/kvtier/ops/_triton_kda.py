"""Triton launchers of the KDA and short-conv kernels (:mod:`kvtier.triton_kernels.kda`,
:mod:`kvtier.triton_kernels.kda_conv`): allocate, lay out, launch. Imported only when the
``triton`` backend is resolved; callers (:mod:`kvtier.ops.kda`) have checked shapes and dtypes.

Nothing here reads a device value on the host: checkpoint requests become a CSR table by
sequence with device ops (stable sort, scatter-add), packed tokens find their sequence with
``searchsorted``, so the launches can be captured in a CUDA/HIP graph.
"""

from __future__ import annotations

import torch
import triton

from kvtier.ops._triton import launchable

def _launch(kernel, grid, *args, **kwargs) -> None:
    launchable(kernel, args[0].device)[grid](*args, **kwargs)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` if everything but its leading (token) axis is contiguous, else a contiguous copy."""
    inner = x[0] if x.shape[0] else x
    return x if x.shape[0] == 0 or inner.is_contiguous() else x.contiguous()


def _dummy(device, dtype=torch.int32) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


def checkpoint_table(checkpoint_seq, checkpoint_len, batch: int, device):
    """(ptr [batch + 1], pos [n], row [n]) int32: sequence b's checkpoints are rows ptr[b]:ptr[b+1]
    of pos/row, positions ascending; ``row`` is the index into the caller's request list."""
    ptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    if checkpoint_seq is None or checkpoint_seq.numel() == 0:
        return ptr, _dummy(device), _dummy(device)
    seq, pos = checkpoint_seq.long(), checkpoint_len.long()
    order = torch.argsort(seq * (1 << 32) + pos, stable=True)
    counts = torch.zeros(batch, dtype=torch.int64, device=device).scatter_add_(0, seq, torch.ones_like(seq))
    ptr[1:] = counts.cumsum(0).to(torch.int32)
    return ptr, pos[order].to(torch.int32).contiguous(), order.to(torch.int32).contiguous()


def _kda_blocks(head_k_dim: int, head_v_dim: int) -> tuple[int, int]:
    from kvtier.triton_kernels.kda import KDA_BLOCK_V

    # at least 16: tl.dot's smallest tile (the chunked kernel); masks cover the padding
    return max(16, triton.next_power_of_2(head_k_dim)), max(16, min(triton.next_power_of_2(head_v_dim), KDA_BLOCK_V))


def kda_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens, scale: float, chunk_size: int,
                      use_qk_l2norm: bool, checkpoint_seq, checkpoint_len):
    """Returns (o, final_state fp32, checkpoint_states fp32) as :func:`kvtier.ops.kda.kda_chunk_prefill`.

    ``chunk_size`` 1 runs the token-walking kernel (:mod:`kvtier.triton_kernels.kda`, fp32 math
    throughout); any other value the chunked kernel (:mod:`kvtier.triton_kernels.kda_chunked`) in
    chunks of ``min(chunk_size, KDA_CHUNK_BT)`` tokens (16: its register budget at head dim 128),
    its matrix products taking operands in the input dtype on a GPU (fp32 for fp32 inputs and
    under the interpreter; :func:`kvtier.ops._triton.triton_dot_dtype`).
    """
    from kvtier.ops._triton import triton_dot_dtype
    from kvtier.triton_kernels.kda import KDA_NUM_WARPS, kda_prefill_kernel
    from kvtier.triton_kernels.kda_chunked import (
        KDA_CHUNK_BLOCK_KS,
        KDA_CHUNK_BT,
        KDA_CHUNK_NUM_WARPS,
        kda_prefill_chunked_kernel,
    )

    num_tokens, num_heads, head_k_dim = q.shape
    head_v_dim, batch, dev = v.shape[2], cu_seqlens.numel() - 1, q.device
    q, k, v, g = (_rows(x) for x in (q, k, v, g))
    beta = beta.contiguous()
    o = torch.empty(num_tokens, num_heads, head_v_dim, dtype=q.dtype, device=dev)
    final = torch.empty(batch, num_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=dev)
    n = 0 if checkpoint_seq is None else checkpoint_seq.numel()
    ckpts = torch.empty(n, num_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=dev)
    if batch == 0 or num_heads == 0:
        return o, final, ckpts
    ptr, pos, row = checkpoint_table(checkpoint_seq, checkpoint_len, batch, dev)
    init = final if initial_state is None else initial_state.contiguous()
    block_k, block_v = _kda_blocks(head_k_dim, head_v_dim)
    grid = (batch, num_heads, triton.cdiv(head_v_dim, block_v))
    args = (q, k, v, g, beta, o, init, final, cu_seqlens, ptr, pos, row, ckpts if n else final, float(scale),
            num_heads, head_k_dim, head_v_dim, q.stride(0), k.stride(0), v.stride(0), g.stride(0))
    flags = dict(HAS_INITIAL=initial_state is not None, USE_L2NORM=bool(use_qk_l2norm), BLOCK_K=block_k,
                 BLOCK_V=block_v)
    if chunk_size == 1:
        _launch(kda_prefill_kernel, grid, *args, **flags, num_warps=KDA_NUM_WARPS)
    else:
        bt = max(16, min(triton.next_power_of_2(chunk_size), KDA_CHUNK_BT))  # tl.dot takes >= 16 rows
        _launch(kda_prefill_chunked_kernel, grid, *args, **flags, BT=bt, BLOCK_KS=min(KDA_CHUNK_BLOCK_KS, block_k),
                DOT_DTYPE=triton_dot_dtype(q.dtype, dev), num_warps=KDA_CHUNK_NUM_WARPS)
    return o, final, ckpts


def kda_recurrent_decode(q, k, v, g, beta, recurrent_state, state_indices, scale: float, use_qk_l2norm: bool):
    """Returns o; updates ``recurrent_state`` (contiguous) in place at ``state_indices >= 0``."""
    from kvtier.triton_kernels.kda import KDA_NUM_WARPS, kda_decode_kernel

    batch, num_heads, head_k_dim = q.shape
    head_v_dim = v.shape[2]
    q, k, v, g = (_rows(x) for x in (q, k, v, g))
    o = torch.empty(batch, num_heads, head_v_dim, dtype=q.dtype, device=q.device)
    if batch == 0 or num_heads == 0:
        return o
    block_k, block_v = _kda_blocks(head_k_dim, head_v_dim)
    grid = (batch, num_heads, triton.cdiv(head_v_dim, block_v))
    _launch(kda_decode_kernel, grid, q, k, v, g, beta.contiguous(), o, recurrent_state, state_indices,
            float(scale), num_heads, head_k_dim, head_v_dim, q.stride(0), k.stride(0), v.stride(0), g.stride(0),
            USE_L2NORM=bool(use_qk_l2norm), BLOCK_K=block_k, BLOCK_V=block_v, num_warps=KDA_NUM_WARPS)
    return o


def causal_conv1d_prefill(x, weight, bias, conv_state, cu_seqlens, silu: bool):
    """Returns (y, final_conv_state) as :func:`kvtier.ops.kda.causal_conv1d_prefill`."""
    from kvtier.triton_kernels.kda_conv import (
        CONV_BLOCK_D,
        CONV_BLOCK_T,
        CONV_NUM_WARPS,
        conv_final_state_kernel,
        conv_prefill_kernel,
    )

    num_tokens, dim = x.shape
    width, batch, dev = weight.shape[1], cu_seqlens.numel() - 1, x.device
    x = _rows(x)
    weight = weight.contiguous()
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    y = torch.empty(num_tokens, dim, dtype=x.dtype, device=dev)
    final = torch.empty(batch, dim, width - 1, dtype=state_dtype, device=dev)
    has_state = conv_state is not None
    state = conv_state.contiguous() if has_state else _dummy(dev, x.dtype)
    bias_t = bias.contiguous() if bias is not None else _dummy(dev, x.dtype)
    block_d = min(CONV_BLOCK_D, triton.next_power_of_2(dim))
    if num_tokens and dim:
        seq_ids = (torch.searchsorted(cu_seqlens, torch.arange(num_tokens, dtype=cu_seqlens.dtype, device=dev),
                                      right=True) - 1).to(torch.int32)
        grid = (triton.cdiv(num_tokens, CONV_BLOCK_T), triton.cdiv(dim, block_d))
        _launch(conv_prefill_kernel, grid, x, weight, bias_t, state, y, cu_seqlens, seq_ids, num_tokens, dim,
                x.stride(0), HAS_BIAS=bias is not None, HAS_STATE=has_state, SILU=silu, WIDTH=width,
                BLOCK_T=CONV_BLOCK_T, BLOCK_D=block_d, num_warps=CONV_NUM_WARPS)
    if batch and dim and width > 1:
        grid = (batch, triton.cdiv(dim, block_d))
        _launch(conv_final_state_kernel, grid, x, state, final, cu_seqlens, dim, x.stride(0) if num_tokens else dim,
                HAS_STATE=has_state, WIDTH=width, BLOCK_W=triton.next_power_of_2(width - 1), BLOCK_D=block_d,
                num_warps=CONV_NUM_WARPS)
    return y, final


def causal_conv1d_update(x, weight, bias, conv_state, state_indices, silu: bool):
    """Returns y; shifts ``conv_state`` (contiguous) in place at ``state_indices >= 0``."""
    from kvtier.triton_kernels.kda_conv import CONV_BLOCK_D, CONV_NUM_WARPS, conv_update_kernel

    batch, dim = x.shape
    width = weight.shape[1]
    y = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    if batch == 0 or dim == 0:
        return y
    x = _rows(x)
    bias_t = bias.contiguous() if bias is not None else _dummy(x.device, x.dtype)
    block_d = min(CONV_BLOCK_D, triton.next_power_of_2(dim))
    _launch(conv_update_kernel, (batch, triton.cdiv(dim, block_d)), x, weight.contiguous(), bias_t, conv_state,
            state_indices, y, dim, x.stride(0), HAS_BIAS=bias is not None, SILU=silu, WIDTH=width,
            BLOCK_W=triton.next_power_of_2(width), BLOCK_D=block_d, num_warps=CONV_NUM_WARPS)
    return y
