"""Split-KV paged MLA decode (weight-absorbed: one latent KV head shared by all query heads).

Stage 1, :func:`mla_decode_partial_kernel`, grid ``(batch, cdiv(num_heads, BLOCK_H), NUM_SPLITS)``:
each program takes ``BLOCK_H`` heads of one sequence and one contiguous slice of its keys
(``cdiv(seq_len, NUM_SPLITS)`` tokens), runs an online softmax over ``BLOCK_N``-token tiles
gathered through ``block_table``, and writes the slice's normalised output and log-sum-exp.
Stage 2, :func:`mla_decode_merge_kernel`, grid ``(batch, num_heads)``: merges the slices by
their log-sum-exp.

Paged reads: token ``n`` of sequence ``b`` lives at ``kv[block_table[b, n // PAGE_SIZE], n %
PAGE_SIZE]``. Only tokens ``n < seq_lens[b]`` are addressed; every load of a token past the end
is masked (``other=0``) *before* use, so neither ``block_table`` entries past the last used
page (which may hold any value, e.g. 2**31-1) nor unused slots (which may hold NaN) are read.

Precision: loads in the storage dtype (fp32/bf16/fp16, or fp8 e4m3 with a per-tensor
``kv_scale``), dots in ``DOT_DTYPE`` (the input dtype on a GPU, fp32 under the interpreter or
for fp32 inputs, where the dot is IEEE, not TF32), softmax and accumulation in fp32.
Bytes and FLOPs: see :mod:`kvtier.reference.mla`.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, fp8_e4m3_name, register_kernel



@triton.jit
def mla_decode_partial_kernel(
    q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, kv_scale, num_heads, kv_lora_rank, rope_dim,
    stride_q_b, stride_q_h, stride_q_d,
    stride_kv_page, stride_kv_slot, stride_kv_d,
    stride_bt_b,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Partial attention of BLOCK_H heads over one key slice.

    part_out: [batch, num_heads, NUM_SPLITS, BLOCK_C] fp32 (contiguous), the slice's softmax-
    normalised output (0 for an empty slice); part_lse: [batch, num_heads, NUM_SPLITS] fp32,
    natural-log sum-exp of the scaled scores (-inf for an empty slice).
    """
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < num_heads
    mask_c = offs_c < kv_lora_rank
    mask_r = offs_r < rope_dim

    q_rows = q_ptr + b.to(tl.int64) * stride_q_b + offs_h[:, None] * stride_q_h
    q_nope = tl.load(q_rows + offs_c[None, :] * stride_q_d, mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_pe = tl.load(q_rows + (kv_lora_rank + offs_r[None, :]) * stride_q_d, mask=mask_h[:, None] & mask_r[None, :],
                   other=0.0)
    q_nope = q_nope.to(DOT_DTYPE)
    q_pe = q_pe.to(DOT_DTYPE)
    # scores in log2 units: exp2(s * log2e) == exp(s)
    qk_scale = sm_scale * kv_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        rows = kv_ptr + page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_slot
        kv_c = tl.load(rows[:, None] + offs_c[None, :] * stride_kv_d, mask=mask_n[:, None] & mask_c[None, :],
                       other=0.0).to(DOT_DTYPE)
        k_pe = tl.load(rows[:, None] + (kv_lora_rank + offs_r[None, :]) * stride_kv_d,
                       mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(DOT_DTYPE)
        if DOT_DTYPE == tl.float32:
            qk = tl.dot(q_nope, tl.trans(kv_c), input_precision="ieee")
            qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision="ieee")
        else:
            qk = tl.dot(q_nope, tl.trans(kv_c))
            qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk)
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_DTYPE == tl.float32:
            acc = tl.dot(p, kv_c, acc=acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(DOT_DTYPE), kv_c, acc=acc * alpha[:, None])
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc * (kv_scale / tl.where(nonempty, l_i, 1.0))[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    part_rows = (b.to(tl.int64) * num_heads + offs_h) * NUM_SPLITS + split
    tl.store(part_out_ptr + part_rows[:, None] * BLOCK_C + offs_c[None, :], out, mask=mask_h[:, None])
    tl.store(part_lse_ptr + part_rows, lse, mask=mask_h)


@triton.jit
def mla_decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    num_heads, kv_lora_rank,
    stride_o_b, stride_o_h, stride_o_d,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Merge the NUM_SPLITS slices of one (sequence, head): out = sum_s w_s o_s / sum_s w_s with
    w_s = exp(lse_s - max lse). A sequence with no keys gets out = 0 and lse = +inf.

    out: [batch, num_heads, kv_lora_rank] (any float dtype, strided); lse: [batch, num_heads] fp32.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, BLOCK_C)
    mask_s = offs_s < NUM_SPLITS
    row = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS
    lse_s = tl.load(part_lse_ptr + row + offs_s, mask=mask_s, other=float("-inf"))
    peak = tl.max(lse_s, 0)
    has_keys = peak > float("-inf")
    weight = tl.exp(lse_s - tl.where(has_keys, peak, 0.0))  # 0 for empty slices; all 0 without keys
    total = tl.sum(weight, 0)
    part = tl.load(part_out_ptr + (row + offs_s)[:, None] * BLOCK_C + offs_c[None, :], mask=mask_s[:, None],
                   other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.where(has_keys, total, 1.0)
    lse = tl.where(has_keys, peak + tl.log(tl.where(has_keys, total, 1.0)), float("inf"))
    out_row = out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h
    tl.store(out_row + offs_c * stride_o_d, out.to(out_ptr.dtype.element_ty), mask=offs_c < kv_lora_rank)
    tl.store(lse_ptr + b * num_heads + h, lse)


# ---------------------------------------------------------------------------------------------
# Default launch configuration, shared by the launcher and the compile gate.

DECODE_BLOCK_H = 16  # tl.dot needs M >= 16; K2 at TP8 (8 heads) runs half-empty tiles
MERGE_NUM_WARPS = 4
# Per compiler backend ("cuda" = NVIDIA, "hip" = AMD). From the compile gate's resource table at
# K2 shapes: BLOCK_N 32 or 8 warps spill VGPRs to scratch on gfx942/gfx950, and software
# pipelining (num_stages 2) costs registers there without a memory-latency win at this tile.
DECODE_CONFIG = {
    "cuda": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2},
    "hip": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
}


def decode_config(arch: str) -> dict:
    """Launch configuration for ``arch`` (``"gfx942"``, ``"gfx950"``, ``"sm_90"``, ...)."""
    return DECODE_CONFIG["hip" if arch.startswith("gfx") else "cuda"]

# K2 shapes for the compile gate: (label, num_heads, num_splits).
_K2_DECODE = [("h64", 64, 8), ("h8-tp8", 8, 32)]


def _partial_cases(arch: str) -> list[CompileCase]:
    cases = []
    for (label, heads, splits) in _K2_DECODE:
        # runtime values as the launcher passes them: contiguous q [B, H, 576] and cache [P, 64, 576]
        values = {"num_heads": heads, "kv_lora_rank": 512, "rope_dim": 64, "stride_q_b": heads * 576,
                  "stride_q_h": 576, "stride_q_d": 1, "stride_kv_page": 64 * 576, "stride_kv_slot": 576,
                  "stride_kv_d": 1}
        for kv_type, dot in (("bf16", "bf16"), (fp8_e4m3_name(arch), "bf16")):
            sig = {"q_ptr": "*bf16", "kv_ptr": f"*{kv_type}", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                   "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sm_scale": "fp32", "kv_scale": "fp32",
                   "num_heads": "i32", "kv_lora_rank": "i32", "rope_dim": "i32",
                   "stride_q_b": "i32", "stride_q_h": "i32", "stride_q_d": "i32",
                   "stride_kv_page": "i32", "stride_kv_slot": "i32", "stride_kv_d": "i32", "stride_bt_b": "i32"}
            cfg = decode_config(arch)
            consts = {"PAGE_SIZE": 64, "NUM_SPLITS": splits, "BLOCK_H": DECODE_BLOCK_H, "BLOCK_N": cfg["BLOCK_N"],
                      "BLOCK_C": 512, "BLOCK_R": 64, "DOT_DTYPE": tl.bfloat16}
            for k in consts:
                sig[k] = "constexpr"
            cases.append(CompileCase(f"{label}-kv{'fp8' if kv_type != 'bf16' else 'bf16'}", sig, consts,
                                     cfg["num_warps"], cfg["num_stages"], values=values))
    return cases


def _merge_cases(arch: str) -> list[CompileCase]:
    cases = []
    for (label, heads, splits) in _K2_DECODE:
        sig = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
               "num_heads": "i32", "kv_lora_rank": "i32", "stride_o_b": "i32", "stride_o_h": "i32",
               "stride_o_d": "i32", "NUM_SPLITS": "constexpr", "BLOCK_S": "constexpr", "BLOCK_C": "constexpr"}
        consts = {"NUM_SPLITS": splits, "BLOCK_S": triton.next_power_of_2(splits), "BLOCK_C": 512}
        values = {"num_heads": heads, "kv_lora_rank": 512, "stride_o_b": heads * 512, "stride_o_h": 512,
                  "stride_o_d": 1}
        cases.append(CompileCase(f"{label}-bf16", sig, consts, MERGE_NUM_WARPS, 1, values=values))
    return cases


register_kernel("mla_decode_partial", mla_decode_partial_kernel, _partial_cases)
register_kernel("mla_decode_merge", mla_decode_merge_kernel, _merge_cases)
