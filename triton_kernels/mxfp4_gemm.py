"""MXFP4 x bf16 GEMM: one body for a dense linear and for the two grouped GEMMs of a fused
(latent) MoE, as :mod:`kvtier.triton_kernels.quant_gemm` is for INT4.

Weights as Kimi K3 ships its routed experts (compressed-tensors ``mxfp4-pack-quantized``;
formats in :mod:`kvtier.reference.mxfp4`): ``w`` uint8 ``[E, rows, K // 2]`` (two E2M1 codes per
byte, the even K index in the low nibble), ``w_scale`` uint8 ``[E, rows, K // 32]`` (E8M0
exponents, ``2 ** (s - 127)``, 255 = NaN). K must be a multiple of 32 and BLOCK_K a multiple of 32.

Two ways to multiply, one body (``SCALED_DOT``):

* ``SCALED_DOT=False`` (gfx942, sm_90, the interpreter): each ``[BLOCK_K, BLOCK_N]`` weight tile
  is decoded in registers (the nibble's sign, exponent and mantissa bits to fp32, times the
  power-of-two scale built from the E8M0 bits) and, compiled, cast to the activations' dtype for
  ``tl.dot`` (fp32 accumulation). Every byte is loaded once per nibble it holds (the repeat hits L1).
* ``SCALED_DOT=True`` (gfx950): the packed tile ``[BLOCK_K // 2, BLOCK_N]`` and its scales
  ``[BLOCK_N, BLOCK_K // 32]`` go as they are to ``tl.dot_scaled(x, None, "bf16", w, s, "e2m1")``;
  with bf16 activations gfx950 lowers it to its scaled FP4 -> bf16 conversion
  (``v_cvt_scalef32_pk_bf16_fp4``) feeding bf16 MFMAs (the f8f6f4 scaled MFMA needs quantized
  activations, W4A8 / W4A4, not done here: the activations stay bf16).

Row modes as :func:`kvtier.triton_kernels.quant_gemm.w4a16_gemm_kernel` (``GROUPED``, ``GATED``,
``A_PER_TOKEN``, ``HAS_BIAS``; rows from :func:`kvtier.triton_kernels.moe.tile_rows`); the GATED
epilogue is :func:`kvtier.triton_kernels.moe.gated_act` (ACT 0 SiLU, 1 SiTU).

FLOPs ``2 * M * N * K`` per GEMM (``6 * T * top_k * L * I`` per MoE); bytes: ``N * K / 2 + N * K /
32`` per weight of every hit expert + activations.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, register_kernel
from kvtier.triton_kernels.moe import gated_act, tile_rows


@triton.jit
def _e2m1_tile(w_rows, s_rows, kk, w_mask):
    """fp32 ``[BLOCK_K, BLOCK_N]`` weights at K indices ``kk`` of the rows ``w_rows`` / ``s_rows``
    point at (pointer tiles ``[1, BLOCK_N]``); masked entries are 0."""
    byte = tl.load(w_rows + (kk // 2)[:, None], mask=w_mask, other=0).to(tl.int32)
    code = (byte >> ((kk % 2) * 4)[:, None]) & 0xF
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    # E2M1: e == 0 -> m * 0.5 (subnormal); else (1 + m / 2) * 2 ** (e - 1), 2 ** (e - 1) from its fp32 bits
    mag = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * ((e + 126) << 23).to(tl.float32, bitcast=True))
    val = tl.where(code >= 8, -mag, mag)
    s = tl.load(s_rows + (kk // 32)[:, None], mask=w_mask, other=127).to(tl.int32)
    # E8M0: 2 ** (s - 127) is the fp32 with exponent bits s (s >= 1); s == 0 is the subnormal 2 ** -127
    scale = (tl.where(s == 0, 1 << 22, s << 23)).to(tl.float32, bitcast=True)
    scale = tl.where(s == 255, float("nan"), scale)
    return val * scale


@triton.jit
def mxfp4_gemm_kernel(a, w, w_scale, out, bias, topk_weights, sorted_ids, expert_ids, num_padded, num_rows, top_k,
                      N, K, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om, gate_offset,
                      act_beta, act_linear_beta, GROUPED: tl.constexpr, GATED: tl.constexpr,
                      A_PER_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, CLIP_UP: tl.constexpr,
                      SCALED_DOT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of ``a @ dequant(w[e])^T``.

    a: [*, K] bf16/fp16/fp32 (row stride ``stride_am``); w: uint8 [E, rows, K // 2] (strides
    stride_we, stride_wn, 1); w_scale: uint8 [E, rows, K // 32] (strides stride_se, stride_sn, 1);
    out: [*, N] (row stride ``stride_om``); bias [N] (HAS_BIAS); topk_weights [T * top_k] fp32,
    sorted_ids, expert_ids, num_padded int32 (GROUPED); num_rows = M (dense) or T * top_k pairs.
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
    if SCALED_DOT:
        offs_b = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        wp_ptrs = w_rows + offs_b[:, None]  # [BLOCK_K // 2, BLOCK_N] packed along K
        sp_ptrs = w_scale + expert * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn + offs_g[None, :]
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALED_DOT:
            b_mask = ((k0 // 2 + offs_b) < K // 2)[:, None] & col_ok[None, :]
            g_mask = col_ok[:, None] & ((k0 // 32 + offs_g) < K // 32)[None, :]
            wt = tl.load(wp_ptrs + k0 // 2, mask=b_mask, other=0)
            st = tl.load(sp_ptrs + k0 // 32, mask=g_mask, other=127)
            acc = tl.dot_scaled(x, None, "bf16", wt, st, "e2m1", acc)
            if GATED:
                ut = tl.load(wp_ptrs + gate_offset * stride_wn + k0 // 2, mask=b_mask, other=0)
                su = tl.load(sp_ptrs + gate_offset * stride_sn + k0 // 32, mask=g_mask, other=127)
                acc_up = tl.dot_scaled(x, None, "bf16", ut, su, "e2m1", acc_up)
        else:
            if UPCAST:
                x = x.to(tl.float32)
            w_mask = k_ok[:, None] & col_ok[None, :]
            wt = _e2m1_tile(w_rows, s_rows, kk, w_mask)
            acc = tl.dot(x, wt.to(x.dtype), acc, input_precision="ieee")
            if GATED:
                ut = _e2m1_tile(w_rows + gate_offset * stride_wn, s_rows + gate_offset * stride_sn, kk, w_mask)
                acc_up = tl.dot(x, ut.to(x.dtype), acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K
    if GATED:
        res = gated_act(acc, acc_up, act_beta, act_linear_beta, ACT, CLIP_UP)
    elif GROUPED:
        res = acc * tl.load(topk_weights + row, mask=row_ok, other=0.0)[:, None]
    else:
        res = acc
    if HAS_BIAS:
        res += tl.load(bias + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out + row.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, res.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# --------------------------------------------------------------------------------------------
# compile-gate cases: K3 shapes. Latent MoE: E = 896, top-16, I = 3072 at L = 3584 (w13 [896, 6144,
# 1792] uint8, w2 [896, 3584, 1536]), SiTU-GLU; dense: an MXFP4 linear at K3's shared-expert down
# projection (N = 7168, K = 6144). gfx950 builds the scaled-dot variant, the others the register one.

MOE_SHAPES = ((True, 6144, 3584), (False, 3584, 3072))  # (gated, weight rows, K)
LINEAR_SHAPES = ((7168, 6144),)  # (N, K)


def scaled_dot_arch(arch: str) -> bool:
    """Whether ``arch`` runs the ``tl.dot_scaled`` variant (gfx950's scaled MFMA)."""
    return arch == "gfx950"


def _configs(arch: str, n: int, k: int, num_experts: int) -> list[tuple[int, dict]]:
    import json
    from pathlib import Path

    table = json.loads((Path(__file__).parent / "configs" / "quant_gemm.json").read_text())["mxfp4"]
    key = f"E={num_experts},N={n},K={k},arch={arch}"
    buckets = table["configs"].get(key, table["default"])
    return sorted(((int(m), cfg) for m, cfg in buckets.items()), key=lambda mc: mc[0])


def _cases(arch: str) -> list[CompileCase]:
    sig0 = {"a": "*bf16", "w": "*u8", "w_scale": "*u8", "out": None, "bias": "*bf16", "topk_weights": "*fp32",
            "sorted_ids": "*i32", "expert_ids": "*i32", "num_padded": "*i32", "num_rows": "i32", "top_k": "i32",
            "N": "i32", "K": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32",
            "stride_sn": "i32", "stride_om": "i32", "gate_offset": "i32", "act_beta": "fp32",
            "act_linear_beta": "fp32"}
    cases = []
    shapes = [(True, gated, rows, k, 896) for gated, rows, k in MOE_SHAPES]
    shapes += [(False, False, n, k, 1) for n, k in LINEAR_SHAPES]
    for grouped, gated, rows, k, experts in shapes:
        for m, cfg in _configs(arch, rows, k, experts):
            inter, hidden = (rows // 2, k) if gated else (k, rows)
            n_out = inter if gated else (hidden if grouped else rows)
            consts = {"GROUPED": grouped, "GATED": gated, "A_PER_TOKEN": gated, "HAS_BIAS": False,
                      "ACT": int(gated), "CLIP_UP": gated, "SCALED_DOT": scaled_dot_arch(arch), "UPCAST": False,
                      "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}
            sig = dict(sig0, out="*bf16" if gated or not grouped else "*fp32")
            sig.update({c: "constexpr" for c in consts})
            values = {"top_k": 16 if grouped else 1, "N": n_out, "K": k, "stride_am": k, "stride_we": rows * k // 2,
                      "stride_wn": k // 2, "stride_se": rows * k // 32, "stride_sn": k // 32, "stride_om": n_out,
                      "gate_offset": inter if gated else 0}
            label = (f"k3-{'w13-situ' if gated else 'w2'}-m{m}" if grouped else f"linear-n{rows}-k{k}-m{m}")
            cases.append(CompileCase(label, sig, consts, cfg["num_warps"], cfg["num_stages"], values=values))
    return cases


register_kernel("mxfp4_gemm", mxfp4_gemm_kernel, _cases)
