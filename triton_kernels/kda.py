"""Kimi Delta Attention (KDA) kernels: prefill over a packed batch and one decode step over state slots.

(The chunked prefill, used unless ``chunk_size=1``, is :mod:`kvtier.triton_kernels.kda_chunked`.)
Both kernels here walk the recurrence token by token (the recurrent form of :mod:`kvtier.reference.kda`) with
one ``[BLOCK_K, BLOCK_V]`` tile of a head's fp32 state held in registers::

    S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale * S^T q_t

``q_t``/``k_t`` are l2-normalised over K in fp32 when ``USE_L2NORM`` (``x / sqrt(|x|^2 + 1e-6)``).
A program owns (sequence, head, V tile): the V columns of the state are independent, so V is tiled
(``BLOCK_V`` columns) to bound registers and to give short batches more programs; K is whole
(``BLOCK_K`` >= K, masked). Inputs load in their dtype (fp32/bf16/fp16) and compute in fp32; o is
stored in its dtype, the state in the state's dtype (fp32 in K3's engines).

Layouts: q, k, g ``[tokens, H, K]`` and v ``[tokens, H, V]`` with contiguous heads and dims and
any token stride (so q, k, v may be views of one fused projection); beta ``[tokens, H]``
contiguous; states ``[*, H, K, V]`` contiguous.

Bytes and FLOPs: see :mod:`kvtier.reference.kda` (the recurrent form: ``7*K*V`` FLOPs per token
and head; decode moves each slot's state twice).
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, register_kernel


@triton.jit
def _load_qkgb(q_ptr, k_ptr, g_ptr, beta_ptr, tok, head, num_heads, stride_q_t, stride_k_t, stride_g_t, scale,
               offs_k, mask_k, USE_L2NORM: tl.constexpr):
    """fp32 (scaled, normalised q; normalised k; exp(g); beta) of token ``tok`` (int64); the q/k/g
    pointers already point at head ``head``."""
    q = tl.load(q_ptr + tok * stride_q_t + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + tok * stride_k_t + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + tok * stride_g_t + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tok * num_heads + head).to(tl.float32)
    if USE_L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    return q * scale, k, tl.exp(g), beta


@triton.jit
def _delta_step(state, q, k, decay, beta, v):
    """One token: returns (new state [BLOCK_K, BLOCK_V], o [BLOCK_V]) in fp32."""
    state = state * decay[:, None]
    kv = tl.sum(state * k[:, None], axis=0)
    state = state + k[:, None] * (beta * (v - kv))[None, :]
    o = tl.sum(state * q[:, None], axis=0)
    return state, o


@triton.jit
def kda_prefill_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, init_ptr, final_ptr, cu_seqlens_ptr,
                       ckpt_ptr_ptr, ckpt_pos_ptr, ckpt_row_ptr, ckpt_out_ptr, scale, num_heads, head_k_dim,
                       head_v_dim, stride_q_t, stride_k_t, stride_v_t, stride_g_t,
                       HAS_INITIAL: tl.constexpr, USE_L2NORM: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    """Grid ``(batch, num_heads, cdiv(V, BLOCK_V))``: one sequence's new tokens for one head and V tile.

    init_ptr: [batch, H, K, V] initial states (read when HAS_INITIAL, else zeros); final_ptr: the
    same shape, written. o_ptr: [tokens, H, V] contiguous. Checkpoints as CSR by sequence:
    ckpt_ptr_ptr [batch + 1] int32 offsets into ckpt_pos/ckpt_row [n] int32, positions ascending
    within a sequence; the state after ``ckpt_pos[c]`` new tokens goes to ``ckpt_out[ckpt_row[c]]``
    ([n, H, K, V] fp32).
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    vt = tl.program_id(2)
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - bos
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < head_k_dim
    mask_v = offs_v < head_v_dim
    mask_kv = mask_k[:, None] & mask_v[None, :]
    head_kv = head.to(tl.int64) * head_k_dim * head_v_dim
    tile = offs_k[:, None] * head_v_dim + offs_v[None, :]
    state_stride = num_heads.to(tl.int64) * head_k_dim * head_v_dim
    if HAS_INITIAL:
        state = tl.load(init_ptr + seq * state_stride + head_kv + tile, mask=mask_kv, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    c = tl.load(ckpt_ptr_ptr + seq)
    c_end = tl.load(ckpt_ptr_ptr + seq + 1)
    next_pos = tl.load(ckpt_pos_ptr + c, mask=c < c_end, other=-1)
    while next_pos == 0:
        row = tl.load(ckpt_row_ptr + c).to(tl.int64)
        tl.store(ckpt_out_ptr + row * state_stride + head_kv + tile, state, mask=mask_kv)
        c += 1
        next_pos = tl.load(ckpt_pos_ptr + c, mask=c < c_end, other=-1)
    q_head = q_ptr + head * head_k_dim
    k_head = k_ptr + head * head_k_dim
    g_head = g_ptr + head * head_k_dim
    v_head = v_ptr + head * head_v_dim
    for i in range(0, seq_len):
        tok = bos + i
        q, k, decay, beta = _load_qkgb(q_head, k_head, g_head, beta_ptr, tok, head, num_heads, stride_q_t,
                                       stride_k_t, stride_g_t, scale, offs_k, mask_k, USE_L2NORM)
        v = tl.load(v_head + tok * stride_v_t + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        state, o = _delta_step(state, q, k, decay, beta, v)
        tl.store(o_ptr + (tok * num_heads + head) * head_v_dim + offs_v, o, mask=mask_v)
        while next_pos == i + 1:
            row = tl.load(ckpt_row_ptr + c).to(tl.int64)
            tl.store(ckpt_out_ptr + row * state_stride + head_kv + tile, state, mask=mask_kv)
            c += 1
            next_pos = tl.load(ckpt_pos_ptr + c, mask=c < c_end, other=-1)
    tl.store(final_ptr + seq * state_stride + head_kv + tile, state, mask=mask_kv)


@triton.jit
def kda_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, state_indices_ptr, scale, num_heads,
                      head_k_dim, head_v_dim, stride_q_b, stride_k_b, stride_v_b, stride_g_b,
                      USE_L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid ``(batch, num_heads, cdiv(V, BLOCK_V))``: one token of sequence ``b`` against its slot.

    state_ptr: [num_slots, H, K, V], rows ``state_indices[b]`` read and written in place; a
    negative index writes zeros to o and touches no state. o_ptr: [batch, H, V] contiguous.
    """
    b = tl.program_id(0)
    head = tl.program_id(1)
    vt = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < head_k_dim
    mask_v = offs_v < head_v_dim
    o_out = o_ptr + (b.to(tl.int64) * num_heads + head) * head_v_dim + offs_v
    slot = tl.load(state_indices_ptr + b).to(tl.int64)
    if slot < 0:
        tl.store(o_out, tl.zeros([BLOCK_V], dtype=tl.float32), mask=mask_v)
    else:
        mask_kv = mask_k[:, None] & mask_v[None, :]
        tile = (state_ptr + (slot * num_heads + head) * head_k_dim * head_v_dim
                + offs_k[:, None] * head_v_dim + offs_v[None, :])
        state = tl.load(tile, mask=mask_kv, other=0.0).to(tl.float32)
        row = b.to(tl.int64)
        q, k, decay, beta = _load_qkgb(q_ptr + head * head_k_dim, k_ptr + head * head_k_dim,
                                       g_ptr + head * head_k_dim, beta_ptr, row, head, num_heads, stride_q_b,
                                       stride_k_b, stride_g_b, scale, offs_k, mask_k, USE_L2NORM)
        v = tl.load(v_ptr + row * stride_v_b + head * head_v_dim + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        state, o = _delta_step(state, q, k, decay, beta, v)
        tl.store(tile, state, mask=mask_kv)
        tl.store(o_out, o, mask=mask_v)


# K3: linear_attn_config num_heads 96, head_dim 128 (K = V = 128), chunk 64 (the recurrent form
# has no chunks); bf16 q/k/v/g/beta/o and fp32 states. V tiles of 32 columns: a 128 x 32 fp32
# tile is 32 registers per thread at 4 warps, and a batch-1 decode gets 96 * 4 programs.
K3_HEADS, K3_HEAD_DIM, KDA_BLOCK_V, KDA_NUM_WARPS = 96, 128, 32, 4


def _prefill_cases(arch: str) -> list[CompileCase]:
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
           "o_ptr": "*bf16", "init_ptr": "*fp32", "final_ptr": "*fp32", "cu_seqlens_ptr": "*i32",
           "ckpt_ptr_ptr": "*i32", "ckpt_pos_ptr": "*i32", "ckpt_row_ptr": "*i32", "ckpt_out_ptr": "*fp32",
           "scale": "fp32", "num_heads": "i32", "head_k_dim": "i32", "head_v_dim": "i32", "stride_q_t": "i32",
           "stride_k_t": "i32", "stride_v_t": "i32", "stride_g_t": "i32", "HAS_INITIAL": "constexpr",
           "USE_L2NORM": "constexpr", "BLOCK_K": "constexpr", "BLOCK_V": "constexpr"}
    hk = K3_HEADS * K3_HEAD_DIM
    # q, k, v as views of the fused conv output [tokens, 3 * H * K]; g its own [tokens, H, K]
    values = {"num_heads": K3_HEADS, "head_k_dim": K3_HEAD_DIM, "head_v_dim": K3_HEAD_DIM, "stride_q_t": 3 * hk,
              "stride_k_t": 3 * hk, "stride_v_t": 3 * hk, "stride_g_t": hk}
    consts = {"HAS_INITIAL": True, "USE_L2NORM": True, "BLOCK_K": K3_HEAD_DIM, "BLOCK_V": KDA_BLOCK_V}
    return [CompileCase("k3-h96-d128-bf16", sig, consts, KDA_NUM_WARPS, 1, values=values)]


def _decode_cases(arch: str) -> list[CompileCase]:
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
           "o_ptr": "*bf16", "state_ptr": "*fp32", "state_indices_ptr": "*i32", "scale": "fp32", "num_heads": "i32",
           "head_k_dim": "i32", "head_v_dim": "i32", "stride_q_b": "i32", "stride_k_b": "i32", "stride_v_b": "i32",
           "stride_g_b": "i32", "USE_L2NORM": "constexpr", "BLOCK_K": "constexpr", "BLOCK_V": "constexpr"}
    hk = K3_HEADS * K3_HEAD_DIM
    values = {"num_heads": K3_HEADS, "head_k_dim": K3_HEAD_DIM, "head_v_dim": K3_HEAD_DIM, "stride_q_b": 3 * hk,
              "stride_k_b": 3 * hk, "stride_v_b": 3 * hk, "stride_g_b": hk}
    consts = {"USE_L2NORM": True, "BLOCK_K": K3_HEAD_DIM, "BLOCK_V": KDA_BLOCK_V}
    return [CompileCase("k3-h96-d128-bf16", sig, consts, KDA_NUM_WARPS, 1, values=values)]


register_kernel("kda_prefill", kda_prefill_kernel, _prefill_cases)
register_kernel("kda_decode", kda_decode_kernel, _decode_cases)
