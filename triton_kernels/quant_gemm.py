"""Quantized-weight GEMMs: INT4-group W4A16 and FP8-block W8A8, each one body for a dense linear
and for the two grouped GEMMs of a fused MoE.

Weights are read as the checkpoints ship them (:mod:`kvtier.reference.quant` has the formats):

* :func:`w4a16_gemm_kernel`: ``w`` int32 ``[E, rows, K // 8]`` (eight K-consecutive nibbles per
  int32, lowest first, each ``q + 8``), ``w_scale`` ``[E, rows, K // group_size]`` (any float).
  Each ``[BLOCK_K, BLOCK_N]`` weight tile is unpacked in registers (every int32 is loaded once per
  nibble it holds; the repeats hit L1, DRAM reads each byte once), scaled in fp32
  (``q * scale[n, k // group_size]``) and, compiled, cast to the activations' dtype for ``tl.dot``
  (fp32 accumulation), as peers' W4A16 Triton kernels do.
* :func:`fp8_block_gemm_kernel`: ``w`` fp8 e4m3 ``[E, rows, K]``, ``w_scale`` fp32
  ``[E, ceil(rows / block_n), ceil(K / BLOCK_K)]``; ``BLOCK_K`` is the quantization block of K.
  Each K block of the activations is quantized in registers, per row (DeepSeek-V3 ``act_quant``):
  ``s = max(amax, 1e-10) / FP8_MAX``, ``x_q = clamp(x / s)`` in the weight's fp8 dtype; the fp8
  ``tl.dot`` (fp32 out) is scaled by ``s[m] * w_scale[n // block_n, kb]`` and accumulated in fp32.

Row modes (``GROUPED``): dense (``GROUPED=False``) rows ``pid_m * BLOCK_M + i`` of ``a`` [M, K],
expert 0, optional ``bias``; grouped (MoE, after ``moe_align_block_size``, the row layout of
:func:`kvtier.triton_kernels.moe.fused_moe_kernel`): ``sorted_ids`` maps each padded row to a
(token, choice) pair, ``expert_ids`` gives each row block's expert. ``GATED`` (first MoE GEMM)
reads gate rows ``n`` and up rows ``gate_offset + n`` and stores ``silu(gate) * up`` in ``out``'s
dtype; the second GEMM multiplies each row by its routing weight and stores fp32. Both kernels
take their rows from :func:`kvtier.triton_kernels.moe.tile_rows`.

``UPCAST`` (set under the interpreter, whose bf16 and fp8 arithmetic is not faithful): tiles go to
``tl.dot`` in fp32, and the fp8 rounding of the activations is done in fp32 arithmetic (round to
nearest even on the e4m3 grid: 3 mantissa bits, smallest normal exponent -6 for e4m3fn, -7 for
e4m3fnuz), which gives the values the compiled conversion gives. The interpreter's fp32 -> bf16
store truncates, so its launcher stores the gated activation in fp32 and rounds it in torch.

FLOPs ``2 * M * N * K`` per GEMM (``6 * T * top_k * H * I`` per MoE); bytes: the weights
(INT4: ``N * K / 2`` + scales; FP8: ``N * K`` + scales) of every hit expert + activations.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, fp8_e4m3_name, register_kernel
from kvtier.triton_kernels.moe import tile_rows


@triton.jit
def w4a16_gemm_kernel(a, w, w_scale, out, bias, topk_weights, sorted_ids, expert_ids, num_padded, num_rows, top_k,
                      N, K, group_size, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om, gate_offset,
                      GROUPED: tl.constexpr, GATED: tl.constexpr, A_PER_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                      UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of ``a @ dequant(w[e])^T``.

    a: [*, K] (row stride ``stride_am``); w: int32 [E, rows, K // 8] (strides stride_we, stride_wn, 1);
    w_scale: [E, rows, K // group_size] (strides stride_se, stride_sn, 1); out: [*, N] (row stride
    ``stride_om``); bias [N] (HAS_BIAS); topk_weights [T * top_k] fp32, sorted_ids, expert_ids,
    num_padded int32 (GROUPED); num_rows = M (dense) or T * top_k pairs (grouped).
    """
    expert, row, row_ok, a_row = tile_rows(sorted_ids, expert_ids, num_padded, num_rows, top_k, GROUPED,
                                           A_PER_TOKEN, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + a_row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_rows = w + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    s_rows = w_scale + expert * stride_se + offs_n.to(tl.int64)[None, :] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        w_mask = k_ok[:, None] & col_ok[None, :]
        shift = ((kk % 8) * 4)[:, None]
        packed = tl.load(w_rows + (kk // 8)[:, None], mask=w_mask, other=0)
        scale = tl.load(s_rows + (kk // group_size)[:, None], mask=w_mask, other=0.0).to(tl.float32)
        wt = (((packed >> shift) & 0xF) - 8).to(tl.float32) * scale
        acc = tl.dot(x, wt.to(x.dtype), acc, input_precision="ieee")
        if GATED:
            packed = tl.load(w_rows + gate_offset * stride_wn + (kk // 8)[:, None], mask=w_mask, other=0)
            scale = tl.load(s_rows + gate_offset * stride_sn + (kk // group_size)[:, None], mask=w_mask,
                            other=0.0).to(tl.float32)
            ut = (((packed >> shift) & 0xF) - 8).to(tl.float32) * scale
            acc_up = tl.dot(x, ut.to(x.dtype), acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K
    if GATED:
        res = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif GROUPED:
        res = acc * tl.load(topk_weights + row, mask=row_ok, other=0.0)[:, None]
    else:
        res = acc
    if HAS_BIAS:
        res += tl.load(bias + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out + row.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, res.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def fp8_block_gemm_kernel(a, w, w_scale, out, bias, topk_weights, sorted_ids, expert_ids, num_padded, num_rows, top_k,
                          N, K, block_n, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                          gate_offset, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, GROUPED: tl.constexpr,
                          GATED: tl.constexpr, A_PER_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                          UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of the W8A8 product ``quant(a) @ dequant(w[e])^T``.

    a: [*, K] float (row stride ``stride_am``); w: fp8 [E, rows, K] (strides stride_we, stride_wn, 1);
    w_scale: fp32 [E, ceil(rows / block_n), ceil(K / BLOCK_K)] (strides stride_se, stride_sn, 1);
    the rest as :func:`w4a16_gemm_kernel`. FP8_MAX: 448.0 (e4m3fn) or 240.0 (e4m3fnuz, FNUZ).
    """
    expert, row, row_ok, a_row = tile_rows(sorted_ids, expert_ids, num_padded, num_rows, top_k, GROUPED,
                                           A_PER_TOKEN, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + a_row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    s_ptrs = w_scale + expert * stride_se + (offs_n // block_n).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        u_ptrs = w_ptrs + gate_offset * stride_wn
        su_ptrs = w_scale + expert * stride_se + ((gate_offset + offs_n) // block_n).to(tl.int64) * stride_sn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / FP8_MAX
        xs = tl.clamp(x / x_scale[:, None], -FP8_MAX, FP8_MAX)
        if UPCAST:
            expo = ((xs.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            if FNUZ:
                expo = tl.maximum(expo, -7)
            else:
                expo = tl.maximum(expo, -6)
            step = ((expo + 124) << 23).to(tl.float32, bitcast=True)  # 2^(expo - 3): the e4m3 spacing
            xq = ((xs / step + 12582912.0) - 12582912.0) * step  # + 1.5 * 2^23 rounds to an integer (RNE)
        else:
            xq = xs.to(w.dtype.element_ty)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wt = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if UPCAST:
            wt = wt.to(tl.float32)
        kb = k0 // BLOCK_K
        w_s = tl.load(s_ptrs + kb, mask=col_ok, other=0.0)
        acc += tl.dot(xq, wt, out_dtype=tl.float32) * x_scale[:, None] * w_s[None, :]
        if GATED:
            ut = tl.load(u_ptrs, mask=w_mask, other=0.0)
            if UPCAST:
                ut = ut.to(tl.float32)
            u_s = tl.load(su_ptrs + kb, mask=col_ok, other=0.0)
            acc_up += tl.dot(xq, ut, out_dtype=tl.float32) * x_scale[:, None] * u_s[None, :]
            u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        res = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif GROUPED:
        res = acc * tl.load(topk_weights + row, mask=row_ok, other=0.0)[:, None]
    else:
        res = acc
    if HAS_BIAS:
        res += tl.load(bias + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out + row.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, res.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# --------------------------------------------------------------------------------------------
# compile-gate cases: K2 shapes (E = 384, H = 7168, I = 2048, top-8; FP8 dense/attention projections)

_COMMON_SIG = {"out": None, "bias": "*bf16", "topk_weights": "*fp32", "sorted_ids": "*i32", "expert_ids": "*i32",
               "num_padded": "*i32", "num_rows": "i32", "top_k": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
               "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_om": "i32",
               "gate_offset": "i32"}
MOE_SHAPES = ((True, 4096, 7168), (False, 7168, 2048))  # (gated, weight rows, K): w13 and w2 of K2
LINEAR_SHAPES = ((7168, 18432), (1536, 7168))  # (N, K): dense down projection, q_a_proj


def _configs(section: str, arch: str, n: int, k: int, num_experts: int) -> list[tuple[int, dict]]:
    import json
    from pathlib import Path

    table = json.loads((Path(__file__).parent / "configs" / "quant_gemm.json").read_text())[section]
    key = f"E={num_experts},N={n},K={k},arch={arch}"
    buckets = table["configs"].get(key, table["default"])
    return sorted(((int(m), cfg) for m, cfg in buckets.items()), key=lambda mc: mc[0])


def _case(fmt: str, label: str, sig_extra: dict, consts: dict, cfg: dict, values: dict, out_ty: str) -> CompileCase:
    sig = dict(_COMMON_SIG, out=out_ty)
    sig.update(sig_extra)
    sig.update({c: "constexpr" for c in consts})
    return CompileCase(label, sig, consts, cfg["num_warps"], cfg["num_stages"], values=values)


def _cases(fmt: str, arch: str) -> list[CompileCase]:
    fp8 = fmt == "fp8_block"
    w_ty = f"*{fp8_e4m3_name(arch)}" if fp8 else "*i32"
    extra = {"a": "*bf16", "w": w_ty, "w_scale": "*fp32" if fp8 else "*bf16"}
    extra["block_n" if fp8 else "group_size"] = "i32"
    pack = 1 if fp8 else 8
    cases = []

    def scales(rows, k):  # (stride_se, stride_sn) of the scale tensor
        cols = -(-k // 128) if fp8 else k // 32
        srows = -(-rows // 128) if fp8 else rows
        return srows * cols, cols

    for gated, rows, k in MOE_SHAPES:
        for m, cfg in _configs(fmt, arch, rows, k, 384):
            inter, hidden = (rows // 2, k) if gated else (k, rows)
            consts = {"GROUPED": True, "GATED": gated, "A_PER_TOKEN": gated, "HAS_BIAS": False, "UPCAST": False,
                      "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": 128 if fp8 else cfg["BLOCK_K"]}
            if fp8:
                consts.update({"FP8_MAX": 240.0 if arch == "gfx942" else 448.0, "FNUZ": arch == "gfx942"})
            se, sn = scales(rows, k)
            values = {"top_k": 8, "N": inter if gated else hidden, "K": k, "stride_am": k,
                      "stride_we": rows * k // pack,
                      "stride_wn": k // pack, "stride_se": se, "stride_sn": sn, "stride_om": inter if gated else hidden,
                      "gate_offset": inter if gated else 0, ("block_n" if fp8 else "group_size"): 128 if fp8 else 32}
            cases.append(_case(fmt, f"k2-{'w13' if gated else 'w2'}-m{m}", extra, consts, cfg, values,
                               "*bf16" if gated else "*fp32"))
    for n, k in LINEAR_SHAPES if fp8 else LINEAR_SHAPES[:1]:
        for m, cfg in _configs(fmt, arch, n, k, 1):
            consts = {"GROUPED": False, "GATED": False, "A_PER_TOKEN": False, "HAS_BIAS": False, "UPCAST": False,
                      "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": 128 if fp8 else cfg["BLOCK_K"]}
            if fp8:
                consts.update({"FP8_MAX": 240.0 if arch == "gfx942" else 448.0, "FNUZ": arch == "gfx942"})
            se, sn = scales(n, k)
            values = {"top_k": 1, "N": n, "K": k, "stride_am": k, "stride_we": n * k // pack, "stride_wn": k // pack,
                      "stride_se": se, "stride_sn": sn, "stride_om": n, "gate_offset": 0,
                      ("block_n" if fp8 else "group_size"): 128 if fp8 else 32}
            cases.append(_case(fmt, f"linear-n{n}-k{k}-m{m}", extra, consts, cfg, values, "*bf16"))
    return cases


register_kernel("w4a16_gemm", w4a16_gemm_kernel, lambda arch: _cases("w4a16", arch))
register_kernel("fp8_block_gemm", fp8_block_gemm_kernel, lambda arch: _cases("fp8_block", arch))
