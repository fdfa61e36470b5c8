"""Mixture-of-experts kernels: noaux_tc routing and the SiLU-gated grouped GEMMs of fused_moe.

Routing (:func:`moe_route_kernel`), one token per program, ``E`` experts padded to ``BLOCK_E``:
score = sigmoid(logit) (fp32), biased = score + bias; group score = sum of the two best biased
scores of the group; the ``topk_group`` best groups are kept; then ``top_k`` rounds of argmax
over the kept experts' biased scores. Ties go to the lower group / expert id. Weights are the
chosen *unbiased* scores, optionally renormalised, times ``routed_scaling_factor``.
Bytes: ``T * E * elem`` read, ``8 * T * top_k`` written.

Grouped GEMM (:func:`fused_moe_kernel`, after ``moe_align_block_size``): the ``T * top_k``
(token, choice) pairs are sorted by expert and each expert's rows padded to ``BLOCK_M``
(``sorted_ids`` holds the flat pair index ``t * top_k + j``, or ``T * top_k`` for padding;
``expert_ids[b]`` is the expert of row block ``b``, ``-1`` past the used blocks). A program
computes a ``[BLOCK_M, BLOCK_N]`` tile of one expert's rows:

* ``GATED`` (first projection): ``act[pair, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, I + n])``
  with both accumulators in fp32, stored in ``act``'s dtype.
* not gated (second projection): ``y[pair, n] = weight[pair] * (act[pair] . w2[e, n])`` in fp32.

Loads are in the storage dtype. ``UPCAST`` converts them to fp32 before the dot (the wrapper
sets it under the interpreter, whose bf16 arithmetic is wrong); compiled, bf16/fp16 tiles go to
``tl.dot`` as they are with fp32 accumulation. The dots use ``input_precision="ieee"`` on every
target and dtype: it is the only value all three targets accept (gfx950 rejects "tf32"), it keeps
fp32 inputs exact (no TF32 rounding, matching the fp32 reference), and for bf16/fp16 operands the
flag changes nothing (the MMA/MFMA multiplies 16-bit operands exactly; checked: the same
mma.sync/wgmma and v_mfma instructions as with "tf32"). FLOPs: ``6 * T * top_k * H * I``; bytes:
the weights of every hit expert (``3 * I * H * elem``) + activations.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, register_kernel


@triton.jit
def moe_route_kernel(router_logits, stride_t, bias, topk_weights, topk_ids, num_experts, per_group, n_group,
                     topk_group, top_k, routed_scaling_factor, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_G: tl.constexpr):
    """router_logits [T, E] float (row stride ``stride_t``); bias [E] float;
    topk_weights [T, top_k] fp32 out; topk_ids [T, top_k] int32 out."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    logit = tl.load(router_logits + t * stride_t + e, mask=valid, other=0.0).to(tl.float32)
    score = 1.0 / (1.0 + tl.exp(-logit))
    biased = tl.where(valid, score + tl.load(bias + e, mask=valid, other=0.0).to(tl.float32), float("-inf"))

    # group scores: [BLOCK_G, BLOCK_E] membership matrix; top-2 sum per group (first max removed once)
    g = tl.arange(0, BLOCK_G)
    member = (e[None, :] // per_group == g[:, None]) & valid[None, :]
    grid_b = tl.where(member, biased[None, :], float("-inf"))
    best = tl.max(grid_b, axis=1)
    first = tl.min(tl.where(member & (grid_b == best[:, None]), e[None, :], BLOCK_E), axis=1)
    second = tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), grid_b), axis=1)
    group_score = tl.where(g < n_group, best + second, float("-inf"))

    kept_group = g < 0
    for _ in range(topk_group):
        gmax = tl.max(group_score, axis=0)
        gsel = tl.min(tl.where(group_score == gmax, g, BLOCK_G), axis=0)
        kept_group = kept_group | (g == gsel)
        group_score = tl.where(g == gsel, float("-inf"), group_score)
    kept = tl.max(tl.where(member & kept_group[:, None], 1, 0), axis=0) > 0
    cand = tl.where(kept, biased, float("-inf"))

    out_w = topk_weights + t * top_k
    out_i = topk_ids + t * top_k
    wsum = tl.full((), 0.0, tl.float32)
    for j in range(top_k):
        cmax = tl.max(cand, axis=0)
        pick = tl.min(tl.where(cand == cmax, e, BLOCK_E), axis=0)
        w = tl.sum(tl.where(e == pick, score, 0.0), axis=0)
        tl.store(out_w + j, w)
        tl.store(out_i + j, pick)
        wsum += w
        cand = tl.where(e == pick, float("-inf"), cand)

    if RENORMALIZE:
        factor = routed_scaling_factor / (wsum + 1e-20)
    else:
        factor = routed_scaling_factor
    for j in range(top_k):
        w = tl.load(out_w + j)
        tl.store(out_w + j, w * factor)


@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice call, so one body for every target): ``sign(x) (1 - t) / (1 + t)``
    with ``t = exp(-2 |x|)``."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def gated_act(gate, up, act_beta, act_linear_beta, ACT: tl.constexpr, CLIP_UP: tl.constexpr):
    """The gated activation of two fp32 tiles (:func:`kvtier.reference.activation.gated_act`):
    ACT 0 = SiLU-GLU ``silu(gate) * up``; ACT 1 = SiTU-GLU ``beta * tanh(gate / beta) *
    sigmoid(gate) * up'`` with ``up' = linear_beta * tanh(up / linear_beta)`` if CLIP_UP else
    ``up`` (vllm ``SituAndMul``, used by ``vllm/models/kimi_k3``; K3 report arXiv 2607.24653)."""
    if ACT == 1:
        g = act_beta * _tanh(gate / act_beta) / (1.0 + tl.exp(-gate))
        if CLIP_UP:
            up = act_linear_beta * _tanh(up / act_linear_beta)
    else:
        g = gate / (1.0 + tl.exp(-gate))
    return g * up


@triton.jit
def tile_rows(sorted_ids, expert_ids, num_padded, num_rows, top_k, GROUPED: tl.constexpr,
              A_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of row block ``program_id(0)``: ``(expert, row, row_ok, a_row)``.

    GROUPED (the sorted layout above; ``num_padded`` [1] int32): ``expert`` = ``expert_ids[pid_m]``
    as an int64 scalar, ``-1`` for a block at or past ``num_padded`` (the caller returns on
    ``expert < 0``); ``row`` [BLOCK_M] = the block's ``sorted_ids`` (flat pair indices), ``num_rows``
    for (unread) slots at or past ``num_padded``.
    Dense: ``expert`` = 0 (a constexpr), ``row`` = ``pid_m * BLOCK_M + arange(BLOCK_M)``.
    ``row_ok = row < num_rows`` (num_rows: ``T * top_k`` pairs, or M dense); ``a_row`` = the
    activation row, ``row // top_k`` if A_PER_TOKEN else ``row``.
    """
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if GROUPED:
        padded = tl.load(num_padded)
        expert = tl.load(expert_ids + pid_m, mask=pid_m * BLOCK_M < padded, other=-1).to(tl.int64)
        row = tl.load(sorted_ids + offs_m, mask=offs_m < padded, other=num_rows)
    else:
        expert = 0
        row = offs_m
    row_ok = row < num_rows
    if A_PER_TOKEN:
        a_row = row // top_k
    else:
        a_row = row
    return expert, row, row_ok, a_row


@triton.jit
def fused_moe_kernel(a, w, out, topk_weights, sorted_ids, expert_ids, num_padded, num_pairs, top_k, N, K,
                     stride_am, stride_we, stride_wn, stride_om, gate_offset, act_beta, act_linear_beta,
                     GATED: tl.constexpr, A_PER_TOKEN: tl.constexpr, ACT: tl.constexpr, CLIP_UP: tl.constexpr,
                     UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile of one expert's sorted rows.

    a: activations; row of pair p is ``p // top_k`` if A_PER_TOKEN (hidden_states [T, K]) else
       ``p`` (act [T * top_k, K]); row stride ``stride_am``, unit column stride.
    w: expert weights [E, rows, K] with strides (stride_we, stride_wn, 1); GATED reads rows n and
       ``gate_offset + n`` (gate, up).
    out: [T * top_k, N] (row stride ``stride_om``): act (GATED) or weighted fp32 products.
    topk_weights: [T * top_k] fp32 (read unless GATED). sorted_ids [num_padded_max] int32;
    expert_ids [num_blocks_max] int32; num_padded [1] int32 = used length of sorted_ids.
    GATED stores :func:`gated_act` (ACT 0 SiLU, 1 SiTU with ``act_beta``, ``act_linear_beta`` if CLIP_UP).
    """
    expert, pair, row_ok, a_row = tile_rows(sorted_ids, expert_ids, num_padded, num_pairs, top_k, True,
                                            A_PER_TOKEN, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + a_row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_base = w + expert * stride_we
    w_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        u_ptrs = w_ptrs + gate_offset * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(x, wt, acc, input_precision="ieee")
        if GATED:
            ut = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                ut = ut.to(tl.float32)
            acc_up = tl.dot(x, ut, acc_up, input_precision="ieee")
            u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        res = gated_act(acc, acc_up, act_beta, act_linear_beta, ACT, CLIP_UP)
    else:
        res = acc * tl.load(topk_weights + pair, mask=row_ok, other=0.0)[:, None]
    o_ptrs = out + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, res.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _route_cases(arch: str) -> list[CompileCase]:
    # K2: E = 384, n_group = topk_group = 1, top-8, fp32 logits; DeepSeek-V3-style 8 groups too.
    sig = {"router_logits": "*fp32", "stride_t": "i32", "bias": "*fp32", "topk_weights": "*fp32", "topk_ids": "*i32",
           "num_experts": "i32", "per_group": "i32", "n_group": "i32", "topk_group": "i32", "top_k": "i32",
           "routed_scaling_factor": "fp32", "RENORMALIZE": "constexpr", "BLOCK_E": "constexpr",
           "BLOCK_G": "constexpr"}
    return [CompileCase(f"k2-e384-g{g}", sig, {"RENORMALIZE": True, "BLOCK_E": 512, "BLOCK_G": g}, 4, 1)
            for g in (1, 8)]


def _gemm_cases(arch: str) -> list[CompileCase]:
    # K2 bf16: gate/up (N = I = 2048 gated columns, K = H = 7168) and down (N = H, K = I), E = 384,
    # top-8, SiLU; K3's latent MoE: E = 896, top-16, I = 3072 at the latent width L = 3584, SiTU-GLU
    # (beta 4, linear_beta 25); at the data file's decode and prefill tile configs for this arch.
    import json
    from pathlib import Path

    table = json.loads((Path(__file__).parent / "configs" / "fused_moe.json").read_text())
    cases = []
    shapes = (("k2", 384, 8, True, 4096, 7168, 0), ("k2", 384, 8, False, 7168, 2048, 0),
              ("k3", 896, 16, True, 6144, 3584, 1), ("k3", 896, 16, False, 3584, 3072, 1))
    for model, experts, top_k, gated, n, k, act in shapes:
        key = f"E={experts},N={n},K={k},dtype=bfloat16,arch={arch}"
        buckets = table["configs"].get(key, table["default"])
        for m, cfg in sorted(buckets.items(), key=lambda kv: int(kv[0])):
            sig = {"a": "*bf16", "w": "*bf16", "out": "*bf16" if gated else "*fp32", "topk_weights": "*fp32",
                   "sorted_ids": "*i32", "expert_ids": "*i32", "num_padded": "*i32", "num_pairs": "i32",
                   "top_k": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_we": "i32",
                   "stride_wn": "i32", "stride_om": "i32", "gate_offset": "i32", "act_beta": "fp32",
                   "act_linear_beta": "fp32"}
            consts = {"GATED": gated, "A_PER_TOKEN": gated, "ACT": act, "CLIP_UP": bool(act), "UPCAST": False,
                      "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}
            sig.update({c: "constexpr" for c in consts})
            inter, hidden = (n // 2, k) if gated else (k, n)
            # runtime values as the launcher passes them (N = output columns: I gated, H down)
            values = {"top_k": top_k, "N": inter if gated else hidden, "K": k, "stride_am": k, "stride_we": n * k,
                      "stride_wn": k, "stride_om": inter if gated else hidden, "gate_offset": inter if gated else 0}
            label = f"{model}-{'w13' if gated else 'w2'}-m{m}-bf16" + ("-situ" if act and gated else "")
            cases.append(CompileCase(label, sig, consts, cfg["num_warps"], cfg["num_stages"], values=values))
    return cases


register_kernel("moe_route", moe_route_kernel, _route_cases)
register_kernel("fused_moe_gemm", fused_moe_kernel, _gemm_cases)
