"""KDA prefill in the chunked ("WY") form: chunks of ``BT`` tokens, one state update per chunk.

Same inputs, outputs and grid as :func:`kvtier.triton_kernels.kda.kda_prefill_kernel` (one
program per sequence, head and ``BLOCK_V`` columns of the state). Per chunk of ``n <= BT``
tokens with cumulative log decays ``G`` (from the chunk's start) and start state ``S``::

    A[t, j]   = beta_t * sum_c k_tc k_jc exp(G_tc - G_jc)     (j < t)
    Aqk[t, j] = scale * sum_c q_tc k_jc exp(G_tc - G_jc)      (j <= t)
    u         = (I + A)^-1 (beta * (v - (k * exp(G)) S))        forward substitution, BT steps
    o         = (scale * q * exp(G)) S + Aqk u
    S        <- exp(G_n) * S + (k * exp(G_n - G))^T u

(derivation in :mod:`kvtier.reference.kda`). The pairwise decays are taken one exponent per
pair, ``exp(G_t - G_j)`` with ``j <= t`` (<= 0), over ``BLOCK_KS``-channel slices of K, never as
``exp(G_t) * exp(-G_j)``: any gate, however strong (K3's lower bound -5 makes ``G`` reach -80 in
16 tokens), stays finite. The four matrix products per chunk take ``DOT_DTYPE`` operands with
fp32 accumulation: fp32 (``input_precision="ieee"``) for fp32 inputs and under the interpreter,
bf16 for bf16 inputs on a GPU (as fla's chunked KDA does; fp32 operands spill on sm_90 at head
dim 128); the state itself stays fp32 in registers. A chunk also ends at each requested
checkpoint, so interior states come out as in the recurrent form.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, register_kernel
from kvtier.triton_kernels.kda import K3_HEAD_DIM, K3_HEADS, KDA_BLOCK_V


@triton.jit
def _pair_scores(q_ptr, k_ptr, g_ptr, tok, rows_ok, inv_q, inv_k, head_k_dim, stride_q_t, stride_k_t, stride_g_t,
                 BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr):
    """(sum_c k_t k_j e^(G_t - G_j), sum_c q_t k_j e^(G_t - G_j)) over j <= t, [BT, BT] fp32 each;
    q and k scaled by ``inv_q`` / ``inv_k`` (their l2 norms, q's times the scale) per row."""
    t_idx = tl.arange(0, BT)
    causal = (t_idx[:, None] >= t_idx[None, :])[:, :, None]
    akk = tl.zeros([BT, BT], dtype=tl.float32)
    aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for c0 in range(0, BLOCK_K, BLOCK_KS):
        cols = c0 + tl.arange(0, BLOCK_KS)
        m = rows_ok[:, None] & (cols < head_k_dim)[None, :]
        ks = tl.load(k_ptr + tok[:, None] * stride_k_t + cols[None, :], mask=m, other=0.0).to(tl.float32)
        qs = tl.load(q_ptr + tok[:, None] * stride_q_t + cols[None, :], mask=m, other=0.0).to(tl.float32)
        gs = tl.cumsum(tl.load(g_ptr + tok[:, None] * stride_g_t + cols[None, :], mask=m, other=0.0).to(tl.float32),
                       axis=0)
        ks = ks * inv_k[:, None]
        qs = qs * inv_q[:, None]
        diff = gs[:, None, :] - gs[None, :, :]
        decay = tl.where(causal, tl.exp(tl.minimum(diff, 0.0)), 0.0)
        kj = ks[None, :, :] * decay
        akk += tl.sum(ks[:, None, :] * kj, axis=2)
        aqk += tl.sum(qs[:, None, :] * kj, axis=2)
    return akk, aqk


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b with fp32 accumulation: fp32 IEEE products, or operands rounded to DOT_DTYPE (bf16/fp16)."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _solve_unit_lower(a, rhs, BT: tl.constexpr):
    """u with (I + a) u = rhs for strictly lower-triangular a [BT, BT]; rhs [BT, BLOCK_V]."""
    rows = tl.arange(0, BT)
    u = rhs
    for i in range(1, BT):
        a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)      # a[i, :], zero from column i on
        contrib = tl.sum(a_row[:, None] * u, axis=0)                       # sum_j<i a[i, j] u[j]
        u = tl.where(rows[:, None] == i, u - contrib[None, :], u)
    return u


@triton.jit
def kda_prefill_chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, init_ptr, final_ptr, cu_seqlens_ptr,
                               ckpt_ptr_ptr, ckpt_pos_ptr, ckpt_row_ptr, ckpt_out_ptr, scale, num_heads, head_k_dim,
                               head_v_dim, stride_q_t, stride_k_t, stride_v_t, stride_g_t,
                               HAS_INITIAL: tl.constexpr, USE_L2NORM: tl.constexpr, BT: tl.constexpr,
                               BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_V: tl.constexpr,
                               DOT_DTYPE: tl.constexpr):
    """Grid ``(batch, num_heads, cdiv(V, BLOCK_V))``; arguments as ``kda_prefill_kernel``'s. DOT_DTYPE:
    the operand dtype of the chunk's matrix products (fp32 = IEEE; bf16/fp16 = tensor-core inputs)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    vt = tl.program_id(2)
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - bos
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BT)
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
    q_head = q_ptr + head * head_k_dim
    k_head = k_ptr + head * head_k_dim
    g_head = g_ptr + head * head_k_dim
    v_head = v_ptr + head * head_v_dim
    c = tl.load(ckpt_ptr_ptr + seq)
    c_end = tl.load(ckpt_ptr_ptr + seq + 1)
    next_pos = tl.load(ckpt_pos_ptr + c, mask=c < c_end, other=-1).to(tl.int64)
    while next_pos == 0:
        row = tl.load(ckpt_row_ptr + c).to(tl.int64)
        tl.store(ckpt_out_ptr + row * state_stride + head_kv + tile, state, mask=mask_kv)
        c += 1
        next_pos = tl.load(ckpt_pos_ptr + c, mask=c < c_end, other=-1).to(tl.int64)
    start = seq_len * 0
    while start < seq_len:
        end = tl.minimum(start + BT, seq_len)
        end = tl.where((next_pos > start) & (next_pos < end), next_pos, end)
        rows_ok = rows < end - start
        tok = bos + start + rows
        m_qk = rows_ok[:, None] & mask_k[None, :]
        k = tl.load(k_head + tok[:, None] * stride_k_t + offs_k[None, :], mask=m_qk, other=0.0).to(tl.float32)
        q = tl.load(q_head + tok[:, None] * stride_q_t + offs_k[None, :], mask=m_qk, other=0.0).to(tl.float32)
        cum = tl.cumsum(tl.load(g_head + tok[:, None] * stride_g_t + offs_k[None, :], mask=m_qk,
                                other=0.0).to(tl.float32), axis=0)
        beta = tl.load(beta_ptr + tok * num_heads + head, mask=rows_ok, other=0.0).to(tl.float32)
        v = tl.load(v_head + tok[:, None] * stride_v_t + offs_v[None, :], mask=rows_ok[:, None] & mask_v[None, :],
                    other=0.0).to(tl.float32)
        inv_q = tl.full([BT], 1.0, tl.float32) * scale
        inv_k = tl.full([BT], 1.0, tl.float32)
        if USE_L2NORM:
            inv_q = scale / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)
            inv_k = 1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)
        q = q * inv_q[:, None]
        k = k * inv_k[:, None]
        akk, aqk = _pair_scores(q_head, k_head, g_head, tok, rows_ok, inv_q, inv_k, head_k_dim, stride_q_t,
                                stride_k_t, stride_g_t, BT, BLOCK_K, BLOCK_KS)
        a = tl.where(rows[:, None] > rows[None, :], akk * beta[:, None], 0.0)
        rhs = beta[:, None] * (v - _mm(k * tl.exp(cum), state, DOT_DTYPE))
        u = _solve_unit_lower(a, rhs, BT)
        o = _mm(q * tl.exp(cum), state, DOT_DTYPE) + _mm(aqk, u, DOT_DTYPE)
        tl.store(o_ptr + (tok[:, None] * num_heads + head) * head_v_dim + offs_v[None, :], o,
                 mask=rows_ok[:, None] & mask_v[None, :])
        last = tl.sum(tl.where(rows[:, None] == end - start - 1, cum, 0.0), axis=0)   # G at the chunk's last token
        k_tail = k * tl.exp(last[None, :] - cum)
        state = tl.exp(last)[:, None] * state + _mm(tl.trans(k_tail), u, DOT_DTYPE)
        start = end
        while next_pos == start:
            row = tl.load(ckpt_row_ptr + c).to(tl.int64)
            tl.store(ckpt_out_ptr + row * state_stride + head_kv + tile, state, mask=mask_kv)
            c += 1
            next_pos = tl.load(ckpt_pos_ptr + c, mask=c < c_end, other=-1).to(tl.int64)
    tl.store(final_ptr + seq * state_stride + head_kv + tile, state, mask=mask_kv)


KDA_CHUNK_BT, KDA_CHUNK_BLOCK_KS, KDA_CHUNK_NUM_WARPS = 16, 16, 4


def _chunked_cases(arch: str) -> list[CompileCase]:
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
           "o_ptr": "*bf16", "init_ptr": "*fp32", "final_ptr": "*fp32", "cu_seqlens_ptr": "*i32",
           "ckpt_ptr_ptr": "*i32", "ckpt_pos_ptr": "*i32", "ckpt_row_ptr": "*i32", "ckpt_out_ptr": "*fp32",
           "scale": "fp32", "num_heads": "i32", "head_k_dim": "i32", "head_v_dim": "i32", "stride_q_t": "i32",
           "stride_k_t": "i32", "stride_v_t": "i32", "stride_g_t": "i32", "HAS_INITIAL": "constexpr",
           "USE_L2NORM": "constexpr", "BT": "constexpr", "BLOCK_K": "constexpr", "BLOCK_KS": "constexpr",
           "BLOCK_V": "constexpr", "DOT_DTYPE": "constexpr"}
    hk = K3_HEADS * K3_HEAD_DIM
    values = {"num_heads": K3_HEADS, "head_k_dim": K3_HEAD_DIM, "head_v_dim": K3_HEAD_DIM, "stride_q_t": 3 * hk,
              "stride_k_t": 3 * hk, "stride_v_t": 3 * hk, "stride_g_t": hk}
    consts = {"HAS_INITIAL": True, "USE_L2NORM": True, "BT": KDA_CHUNK_BT, "BLOCK_K": K3_HEAD_DIM,
              "BLOCK_KS": KDA_CHUNK_BLOCK_KS, "BLOCK_V": KDA_BLOCK_V,
              "DOT_DTYPE": tl.bfloat16}
    return [CompileCase("k3-h96-d128-bt16-bf16", sig, consts, KDA_CHUNK_NUM_WARPS, 1, values=values)]


register_kernel("kda_prefill_chunked", kda_prefill_chunked_kernel, _chunked_cases)
