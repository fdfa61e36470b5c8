"""Ragged causal paged MLA extend (prefill chunks) in the weight-absorbed form.

Grid ``(batch, cdiv(max_new_tokens * num_heads, BLOCK_M))``. For sequence ``b`` with ``n_q`` new
tokens (``cu_seqlens_q[b+1] - cu_seqlens_q[b]``) and ``seq_len`` cached tokens (new ones
included, so its prefix is ``seq_len - n_q``), the rows ``(token, head)`` are flattened as
``row = token * num_heads + head`` and tiled by ``BLOCK_M``: every head of a token shares the one
latent KV row, so a tile of rows is a plain ``[BLOCK_M, D] x [D, BLOCK_N]`` product whatever the
head count. Row ``(t, h)`` sees keys at positions ``<= seq_len - n_q + t`` (the prefix and, causally,
the new tokens); the key loop stops at the last key any row of the tile sees.

Paged reads and precision as in :mod:`kvtier.triton_kernels.mla_decode`: keys past the tile's
last visible position are masked before use (never read), scores of invisible keys are ``-inf``
before the softmax, dots in ``DOT_DTYPE``, softmax and accumulation in fp32. Every new token sees
at least itself, so ``lse`` is finite.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, fp8_e4m3_name, register_kernel


@triton.jit
def mla_extend_kernel(
    q_ptr, kv_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    sm_scale, kv_scale, num_heads, kv_lora_rank, rope_dim,
    stride_q_t, stride_q_h, stride_q_d,
    stride_kv_page, stride_kv_slot, stride_kv_d,
    stride_bt_b,
    stride_o_t, stride_o_h, stride_o_d,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """out: [total_q, num_heads, kv_lora_rank] (strided, any float dtype); lse: [total_q, num_heads] fp32."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    n_q = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if tile * BLOCK_M >= n_q * num_heads:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - n_q

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < n_q * num_heads
    tok = rows // num_heads
    head = rows % num_heads
    q_pos = prefix + tok  # last visible key of each row
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_c = offs_c < kv_lora_rank
    mask_r = offs_r < rope_dim

    q_rows = q_ptr + (q_start + tok).to(tl.int64) * stride_q_t + head * stride_q_h
    q_nope = tl.load(q_rows[:, None] + offs_c[None, :] * stride_q_d, mask=mask_m[:, None] & mask_c[None, :],
                     other=0.0).to(DOT_DTYPE)
    q_pe = tl.load(q_rows[:, None] + (kv_lora_rank + offs_r[None, :]) * stride_q_d,
                   mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(DOT_DTYPE)
    qk_scale = sm_scale * kv_scale * 1.4426950408889634  # log2 units

    last_tok = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, n_q * num_heads - 1) // num_heads
    end = prefix + last_tok + 1  # keys [0, end) are visible to some row of this tile
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        kv_rows = kv_ptr + page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_slot
        kv_c = tl.load(kv_rows[:, None] + offs_c[None, :] * stride_kv_d, mask=mask_n[:, None] & mask_c[None, :],
                       other=0.0).to(DOT_DTYPE)
        k_pe = tl.load(kv_rows[:, None] + (kv_lora_rank + offs_r[None, :]) * stride_kv_d,
                       mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(DOT_DTYPE)
        if DOT_DTYPE == tl.float32:
            qk = tl.dot(q_nope, tl.trans(kv_c), input_precision="ieee")
            qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision="ieee")
        else:
            qk = tl.dot(q_nope, tl.trans(kv_c))
            qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk)
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: key 0 is visible to every row
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_DTYPE == tl.float32:
            acc = tl.dot(p, kv_c, acc=acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(DOT_DTYPE), kv_c, acc=acc * alpha[:, None])
        m_i = m_new

    out = acc * (kv_scale / l_i)[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    out_rows = out_ptr + (q_start + tok).to(tl.int64) * stride_o_t + head * stride_o_h
    tl.store(out_rows[:, None] + offs_c[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_c[None, :])
    tl.store(lse_ptr + (q_start + tok).to(tl.int64) * num_heads + head, lse, mask=mask_m)


# Per compiler backend, from the compile gate's resource table at K2 shapes (see mla_decode). CUDA:
# 8 warps and BLOCK_N 32: a [32, 512] fp32 accumulator on 4 warps spilled on sm_90 (80 B/thread bf16 KV,
# 344 B fp8 KV); on 8 warps it fits (199 / 254 registers, no stack frame).
EXTEND_CONFIG = {
    "cuda": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    "hip": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
}


def extend_config(arch: str) -> dict:
    """Launch configuration for ``arch`` (``"gfx942"``, ``"gfx950"``, ``"sm_90"``, ...)."""
    return EXTEND_CONFIG["hip" if arch.startswith("gfx") else "cuda"]


def _extend_cases(arch: str) -> list[CompileCase]:
    cfg = extend_config(arch)
    cases = []
    for kv_type in ("bf16", fp8_e4m3_name(arch)):
        sig = {"q_ptr": "*bf16", "kv_ptr": f"*{kv_type}", "block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
               "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "sm_scale": "fp32", "kv_scale": "fp32",
               "num_heads": "i32", "kv_lora_rank": "i32", "rope_dim": "i32",
               "stride_q_t": "i32", "stride_q_h": "i32", "stride_q_d": "i32",
               "stride_kv_page": "i32", "stride_kv_slot": "i32", "stride_kv_d": "i32", "stride_bt_b": "i32",
               "stride_o_t": "i32", "stride_o_h": "i32", "stride_o_d": "i32"}
        consts = {"PAGE_SIZE": 64, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_C": 512,
                  "BLOCK_R": 64, "DOT_DTYPE": tl.bfloat16}
        for k in consts:
            sig[k] = "constexpr"
        # the head count is a runtime argument (rows = tokens x heads), so one build serves 64 and 8 heads
        # (num_heads gets no hint: 64 would be specialised as a multiple of 16, 8 not); strides of
        # contiguous q [T, H, 576], out [T, H, 512] and cache [P, 64, 576], which are multiples of 16 at H = 8 and 64
        values = {"kv_lora_rank": 512, "rope_dim": 64, "stride_q_t": 8 * 576, "stride_q_h": 576, "stride_q_d": 1,
                  "stride_kv_page": 64 * 576, "stride_kv_slot": 576, "stride_kv_d": 1, "stride_o_t": 8 * 512,
                  "stride_o_h": 512, "stride_o_d": 1}
        cases.append(CompileCase(f"k2-kv{'bf16' if kv_type == 'bf16' else 'fp8'}", sig, consts, cfg["num_warps"],
                                 cfg["num_stages"], values=values))
    return cases


register_kernel("mla_extend", mla_extend_kernel, _extend_cases)
