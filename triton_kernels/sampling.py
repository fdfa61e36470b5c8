"""Greedy / temperature / top-p sampling with a packed allowed-token bitmask, ``ROWS`` rows per program.

Per row (``V`` = vocab, every pass streams the row in ``BLOCK`` chunks, fp32 math):

1. masked max and argmax of the logits (ties -> lowest id, like ``torch.argmax``); greedy rows
   (``temperature <= 0``) stop here.
2. ``Z = sum exp(s - m)`` over allowed tokens, ``s = logit / temperature``, ``m = max s``.
3. top-p (only when some row of the program has ``top_p < 1``): the kept set is ``{s_j >= thr}`` for the largest threshold
   whose kept mass still reaches ``top_p * Z``. The threshold is found by bisection over the
   order-preserving int32 image of fp32 (32 passes), so it is exact: the kept set equals the
   sorted-prefix rule except that tokens tied with the last kept one are all kept.
4. inverse CDF: with the row's uniform ``u`` in [0, 1) the token is the first ``j`` whose running
   sum of kept ``exp(s - m)`` exceeds ``u * mass``. A token with probability 0 (masked, cut by
   top-p, or underflowed) can never be that first index. If fp32 rounding leaves the target
   unreached, the last kept token with nonzero mass is taken.

Bitmask: word ``i`` bit ``j`` (int32, two's complement) allows token ``32 * i + j``.
Bytes: ``(2 + 32 * [top_p < 1]) * V * elem`` (+ bitmask words per pass) read per sampled row.
"""

import triton
import triton.language as tl

from kvtier.triton_kernels import CompileCase, register_kernel


@triton.jit
def sample_kernel(logits, stride_row, temperature, top_p, uniforms, token_bitmask, stride_mask, out, batch, vocab,
                  HAS_MASK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = sampled token id (int64), for rows ``ROWS * pid ..`` (one row is typical on a GPU;
    the interpreter uses many, as its cost is per operation, not per element).

    logits: [B, V] fp32/bf16/fp16, row stride ``stride_row`` elements.
    temperature, top_p: [B] fp32. uniforms: [B] fp32 in [0, 1) (unused for greedy rows).
    token_bitmask: [B, ceil(V / 32)] int32, row stride ``stride_mask`` (ignored unless HAS_MASK).
    out: [B] int64.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < batch
    row_logits = logits + rows[:, None] * stride_row
    mask_row = token_bitmask + rows[:, None] * stride_mask
    temp = tl.load(temperature + rows, mask=row_ok, other=0.0)
    sampled = row_ok & (temp > 0)
    inv_t = 1.0 / tl.where(sampled, temp, 1.0)
    p = tl.load(top_p + rows, mask=row_ok, other=1.0)
    cut = sampled & (p < 1.0)
    BIG = 2147483647

    # pass 1: masked max / argmax on the raw logits, and the smallest scaled allowed logit
    best = tl.full((ROWS,), float("-inf"), tl.float32)
    best_idx = tl.full((ROWS,), 0, tl.int32)
    lo_val = tl.full((ROWS,), float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = row_ok[:, None] & (offs < vocab)[None, :]
        if HAS_MASK:
            word = tl.load(mask_row + (offs // 32)[None, :], mask=ok, other=0)
            ok = ok & (((word >> (offs % 32)[None, :]) & 1) != 0)
        x = tl.load(row_logits + offs[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        x = tl.where(ok, x, float("-inf"))
        cmax = tl.max(x, axis=1)
        cidx = tl.min(tl.where(x == cmax[:, None], offs[None, :], BIG), axis=1)
        take = cmax > best
        best_idx = tl.where(take, cidx, best_idx)
        best = tl.where(take, cmax, best)
        lo_val = tl.minimum(lo_val, tl.min(tl.where(ok, x * inv_t[:, None], float("inf")), axis=1))

    m = best * inv_t
    # pass 2: normaliser
    total = tl.full((ROWS,), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = sampled[:, None] & (offs < vocab)[None, :]
        if HAS_MASK:
            word = tl.load(mask_row + (offs // 32)[None, :], mask=ok, other=0)
            ok = ok & (((word >> (offs % 32)[None, :]) & 1) != 0)
        s = tl.load(row_logits + offs[None, :], mask=ok, other=0.0).to(tl.float32) * inv_t[:, None]
        total += tl.sum(tl.where(ok, tl.exp(s - m[:, None]), 0.0), axis=1)

    # pass 3: top-p threshold key (largest key whose kept mass reaches top_p * total)
    lo_bits = lo_val.to(tl.int32, bitcast=True)
    lo = tl.where(lo_bits < 0, lo_bits ^ 0x7FFFFFFF, lo_bits).to(tl.int64)
    hi_bits = m.to(tl.int32, bitcast=True)
    hi = tl.where(hi_bits < 0, hi_bits ^ 0x7FFFFFFF, hi_bits).to(tl.int64)
    target = p * total
    if tl.max(cut.to(tl.int32), axis=0) > 0:
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            mass = tl.full((ROWS,), 0.0, tl.float32)
            for start in range(0, vocab, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                ok = cut[:, None] & (offs < vocab)[None, :]
                if HAS_MASK:
                    word = tl.load(mask_row + (offs // 32)[None, :], mask=ok, other=0)
                    ok = ok & (((word >> (offs % 32)[None, :]) & 1) != 0)
                s = tl.load(row_logits + offs[None, :], mask=ok, other=0.0).to(tl.float32) * inv_t[:, None]
                bits = s.to(tl.int32, bitcast=True)
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
                keep = ok & (key >= mid[:, None])
                mass += tl.sum(tl.where(keep, tl.exp(s - m[:, None]), 0.0), axis=1)
            reach = (mass >= target) | ~cut
            lo = tl.where(cut & reach & (hi > lo), mid, lo)  # rows not cut keep every allowed token
            hi = tl.where(reach, hi, mid - 1)

    # pass 4: kept mass (= total where nothing is cut), then the inverse-CDF walk
    kept = tl.full((ROWS,), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = cut[:, None] & (offs < vocab)[None, :]
        if HAS_MASK:
            word = tl.load(mask_row + (offs // 32)[None, :], mask=ok, other=0)
            ok = ok & (((word >> (offs % 32)[None, :]) & 1) != 0)
        s = tl.load(row_logits + offs[None, :], mask=ok, other=0.0).to(tl.float32) * inv_t[:, None]
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        keep = ok & (key >= lo[:, None])
        kept += tl.sum(tl.where(keep, tl.exp(s - m[:, None]), 0.0), axis=1)
    kept = tl.where(cut, kept, total)
    goal = tl.load(uniforms + rows, mask=sampled, other=0.0) * kept
    running = tl.full((ROWS,), 0.0, tl.float32)
    choice = tl.full((ROWS,), BIG, tl.int32)
    last_nonzero = best_idx
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = sampled[:, None] & (offs < vocab)[None, :]
        if HAS_MASK:
            word = tl.load(mask_row + (offs // 32)[None, :], mask=ok, other=0)
            ok = ok & (((word >> (offs % 32)[None, :]) & 1) != 0)
        s = tl.load(row_logits + offs[None, :], mask=ok, other=0.0).to(tl.float32) * inv_t[:, None]
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        keep = ok & (key >= lo[:, None])
        w = tl.where(keep, tl.exp(s - m[:, None]), 0.0)
        csum = running[:, None] + tl.cumsum(w, axis=1)
        hit = (csum > goal[:, None]) & (w > 0)
        choice = tl.minimum(choice, tl.min(tl.where(hit, offs[None, :], BIG), axis=1))
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(w > 0, offs[None, :], -1), axis=1))
        running += tl.sum(w, axis=1)
    choice = tl.where(choice < BIG, choice, last_nonzero)
    choice = tl.where(sampled, choice, best_idx)
    tl.store(out + rows, choice.to(tl.int64), mask=row_ok)


def _sample_cases(arch: str) -> list[CompileCase]:
    # K2 vocab 163840, bf16 logits, one row per program (as the launcher does on a GPU).
    sig = {"logits": "*bf16", "stride_row": "i32", "temperature": "*fp32", "top_p": "*fp32", "uniforms": "*fp32",
           "token_bitmask": "*i32", "stride_mask": "i32", "out": "*i64", "batch": "i32", "vocab": "i32",
           "HAS_MASK": "constexpr", "ROWS": "constexpr", "BLOCK": "constexpr"}
    return [CompileCase(f"k2-v163840-bf16-{'mask' if m else 'nomask'}", sig,
                        {"HAS_MASK": m, "ROWS": 1, "BLOCK": 1024}, 8, 1) for m in (False, True)]


register_kernel("sample", sample_kernel, _sample_cases)
