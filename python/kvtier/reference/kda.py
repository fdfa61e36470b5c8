"""Kimi Delta Attention (KDA) and its causal short convolution: fp32 torch references.

KDA is a gated delta rule with a per-channel decay. Per sequence, per head, per new token ``t``
(``S`` is the ``[K, V]`` recurrent state, ``k_t``/``q_t`` l2-normalised over K when asked)::

    S'  = diag(exp(g_t)) S_{t-1}                      # decay each key channel
    S_t = S' + beta_t * k_t (v_t - S'^T k_t)^T        # delta-rule write
        = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t                           # read after the write

Source of the formula (decay first, then the delta update, then the read): transformers
``models/kimi_linear/modeling_kimi_linear.py`` (``recurrent_kimi_delta_attention`` /
``chunk_kimi_delta_attention``, the pure-torch fallback of ``KimiLinearForCausalLM``) and
fla-core 0.6.0 ``fla/ops/kda/naive.py``; the model is described in the Kimi Linear report
(arXiv 2510.26692). l2norm is ``x / sqrt(sum(x**2) + 1e-6)`` as in both.

The prefill reference computes the same recurrence chunk by chunk (the "WY" form). Inside a
chunk with cumulative log decays ``G_t = g_1 + ... + g_t`` and start state ``S0``, the pseudo
values ``u_t = beta_t (v_t - S'^T k_t)`` solve the unit lower-triangular system
``(I + A) u = beta * (v - (k * exp(G)) S0)`` with
``A[t, j] = beta_t * sum_c k_tc k_jc exp(G_tc - G_jc)`` for ``j < t``; then
``o_t = scale * ((q_t * exp(G_t)) S0 + sum_{j<=t} (q_t . (k_j * exp(G_t - G_j))) u_j)`` and
``S_end = exp(G_end) * S0 + sum_j (k_j * exp(G_end - G_j)) u_j^T``. Every exponent is a
difference ``G_t - G_j`` with ``j <= t``, so it is <= 0 and never overflows, whatever the gate
(e.g. ``g = -5`` for every channel, K3's lower bound, gives ``G = -320`` at the end of a chunk of 64).

FLOPs per token and head (``K``/``V`` head dims, ``C`` chunk size): the recurrent form does
``7*K*V`` (decay, ``S^T k``, rank-1 write, read); the chunked form about ``6*K*V`` (state terms)
``+ 2*C*K + 1.5*C*V`` (intra-chunk scores, triangular solve, intra-chunk output).
DRAM bytes: prefill reads q, k, g (``3*K``) and v (``V``) per token and head in the input dtype,
beta (1), writes o (``V``), plus ``4*K*V`` fp32 per state read or written (initial, final, each
checkpoint); decode reads and writes each slot's state (``8*K*V`` per head, fp32) and moves
``3*K + 2*V + 1`` input/output elements per head.

Conv: a depthwise causal convolution over the packed token axis with kernel ``W`` (4 in K3),
``y[t, d] = act(bias[d] + sum_j weight[d, j] * x[t - W + 1 + j, d])``, where inputs before the
sequence's first new token come from its conv state (the previous ``W - 1`` inputs, oldest
first). Source: transformers ``causal_conv1d_fn`` / ``causal_conv1d_update`` of the same file
(``F.conv1d`` with ``padding=W-1``, ``groups=dim``; SiLU). FLOPs ``2*W*dim`` per token; bytes
``2*dim`` per token plus ``dim*(W-1)`` per state read or written.

These references read lengths on the host and loop over sequences and chunks in Python: they
are for tests and CPU runs at small shapes (the chunk step holds a ``[H, C, C, K]`` fp32 tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
CONV_ACTIVATIONS = ("silu", None)


def kda_prefill_flops(num_tokens: int, num_heads: int, head_k_dim: int, head_v_dim: int, chunk_size: int) -> int:
    """Approximate FLOPs of the chunked prefill (see the module docstring)."""
    per = 6 * head_k_dim * head_v_dim + 2 * chunk_size * head_k_dim + 1.5 * chunk_size * head_v_dim
    return int(num_tokens * num_heads * per)


def kda_decode_bytes(batch: int, num_heads: int, head_k_dim: int, head_v_dim: int, in_bytes: int,
                     state_bytes: int = 4) -> int:
    """DRAM bytes of one decode step: each slot's state read and written, q/k/g/v/beta in, o out."""
    io = (3 * head_k_dim + 2 * head_v_dim + 1) * in_bytes
    return batch * num_heads * (2 * head_k_dim * head_v_dim * state_bytes + io)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` over the last dim (FLA's and transformers' form, not ``F.normalize``)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, scale: float | None, use_qk_l2norm: bool):
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return qf * scale, kf


def _chunk_step(q, k, v, g, beta, state):
    """One chunk of one sequence, all heads at once (fp32).

    q (already scaled), k, g: [H, C, K]; v: [H, C, V]; beta: [H, C]; state: [H, K, V].
    Returns (o [H, C, V], state after the chunk [H, K, V]).
    """
    c = q.shape[1]
    cum = g.cumsum(1)                                                   # G_t, [H, C, K]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # j <= t
    diff = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
    decay = diff.exp()                                                  # exp(G_t - G_j), 0 above the diagonal
    kk = torch.einsum("htc,hjc,htjc->htj", k, k, decay)
    qk = torch.einsum("htc,hjc,htjc->htj", q, k, decay)                 # includes j == t
    strict = kk.tril(-1) * beta[:, :, None]
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * (v - (k * cum.exp()) @ state)
    u = torch.linalg.solve_triangular(eye + strict, rhs, upper=False, unitriangular=True)
    o = (q * cum.exp()) @ state + qk @ u
    last = cum[:, -1:, :]                                               # G_end, [H, 1, K]
    new_state = last.transpose(1, 2).exp() * state + (k * (last - cum).exp()).transpose(1, 2) @ u
    return o, new_state


def _checkpoints_by_seq(checkpoint_seq, checkpoint_len, lengths: list[int]) -> dict[int, dict[int, list[int]]]:
    """{seq: {position: [output rows]}} from the checkpoint arguments (checked here)."""
    if (checkpoint_seq is None) != (checkpoint_len is None):
        raise ValueError("checkpoint_seq and checkpoint_len must be given together (both or neither)")
    if checkpoint_seq is None:
        return {}
    seqs, lens = checkpoint_seq.tolist(), checkpoint_len.tolist()
    if len(seqs) != len(lens):
        raise ValueError(f"checkpoint_len must have shape ({len(seqs)},) like checkpoint_seq, got ({len(lens)},)")
    wanted: dict[int, dict[int, list[int]]] = {}
    for row, (s, n) in enumerate(zip(seqs, lens)):
        if not 0 <= s < len(lengths):
            raise ValueError(f"checkpoint_seq[{row}] must be in [0, batch={len(lengths)}), got {s}")
        if not 0 <= n <= lengths[s]:
            raise ValueError(f"checkpoint_len[{row}] must be in [0, {lengths[s]}] (sequence {s}'s new tokens), "
                             f"got {n}")
        wanted.setdefault(s, {}).setdefault(n, []).append(row)
    return wanted


def kda_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens, *, scale=None, chunk_size=64, use_qk_l2norm=True,
                      checkpoint_seq=None, checkpoint_len=None):
    """KDA over a packed batch of new tokens, from each sequence's initial state (fp32 reference).

    Args:
        q, k: [num_tokens, num_heads, head_k_dim] float (fp32/bf16/fp16), token-major, sequences
            packed back to back as ``cu_seqlens`` says.
        v: [num_tokens, num_heads, head_v_dim] float.
        g: [num_tokens, num_heads, head_k_dim] float, per-channel log decay (<= 0), already
            through the gate activation and its lower bound (the decay factor is ``exp(g)``).
        beta: [num_tokens, num_heads] float, the write strength (already sigmoid-ed, in [0, 1]).
        initial_state: [batch, num_heads, head_k_dim, head_v_dim] fp32 state before each
            sequence's first new token, or None for zeros. Not modified.
        cu_seqlens: [batch + 1] int32, ``cu_seqlens[b]:cu_seqlens[b+1]`` are sequence b's new
            tokens; ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == num_tokens``
            (zero-length sequences allowed: their final state is their initial state).
        scale: query scale, default ``head_k_dim ** -0.5``.
        chunk_size: tokens per chunk of the chunked form (>= 1); changes rounding only.
        use_qk_l2norm: l2-normalise q and k over head_k_dim first (``x / sqrt(|x|^2 + 1e-6)``).
        checkpoint_seq, checkpoint_len: [n] int32 each, or None (both or neither): row i asks for
            the state of sequence ``checkpoint_seq[i]`` after its first ``checkpoint_len[i]`` new
            tokens (0 = its initial state, its length = its final state).

    Returns:
        ``(o, final_state, checkpoint_states)``: o [num_tokens, num_heads, head_v_dim] in q's
        dtype; final_state [batch, num_heads, head_k_dim, head_v_dim] fp32;
        checkpoint_states [n, num_heads, head_k_dim, head_v_dim] fp32 (n = 0 without checkpoints).

    Raises:
        ValueError: only a checkpoint out of range or half given (the op wrapper
            :func:`kvtier.ops.kda.kda_chunk_prefill` checks shapes and dtypes).

    Example:
        >>> T, H, K, V = 5, 2, 4, 3
        >>> q, k, g = torch.randn(T, H, K), torch.randn(T, H, K), -torch.rand(T, H, K)
        >>> o, s, c = kda_chunk_prefill(q, k, torch.randn(T, H, V), g, torch.rand(T, H), None,
        ...                             torch.tensor([0, 2, 5], dtype=torch.int32))
        >>> tuple(o.shape), tuple(s.shape), tuple(c.shape)
        ((5, 2, 3), (2, 2, 4, 3), (0, 2, 4, 3))
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    num_heads, head_k_dim, head_v_dim = q.shape[1], q.shape[2], v.shape[2]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    batch = len(bounds) - 1
    lengths = [bounds[b + 1] - bounds[b] for b in range(batch)]
    wanted = _checkpoints_by_seq(checkpoint_seq, checkpoint_len, lengths)
    qs, ks = _prepare_qk(q, k, scale, use_qk_l2norm)
    # head-major fp32 copies: [H, T, .]
    qs, ks, vs, gs = (x.float().transpose(0, 1) for x in (qs, ks, v, g))
    bs = beta.float().transpose(0, 1)
    shape = (num_heads, head_k_dim, head_v_dim)
    states = (torch.zeros(batch, *shape, device=q.device) if initial_state is None
              else initial_state.float().clone())
    out = torch.zeros(num_heads, q.shape[0], head_v_dim, device=q.device)
    n_ckpt = 0 if checkpoint_seq is None else checkpoint_seq.numel()
    ckpts = torch.zeros(n_ckpt, *shape, device=q.device)
    for b in range(batch):
        start, length, marks = bounds[b], lengths[b], wanted.get(b, {})
        cuts = sorted(set(range(0, length, chunk_size)) | set(marks) | {length})
        state = states[b]
        for lo, hi in zip([None, *cuts], cuts):
            if lo is not None and hi > lo:
                sl = slice(start + lo, start + hi)
                out[:, sl], state = _chunk_step(qs[:, sl], ks[:, sl], vs[:, sl], gs[:, sl], bs[:, sl], state)
            for row in marks.get(hi, ()):
                ckpts[row] = state
        states[b] = state
    return out.transpose(0, 1).to(q.dtype).contiguous(), states, ckpts


def kda_recurrent_decode(q, k, v, g, beta, recurrent_state, state_indices, *, scale=None, use_qk_l2norm=True):
    """One KDA step per sequence, updating its state slot in place (fp32 reference).

    Args:
        q, k, g: [batch, num_heads, head_k_dim] float (g: per-channel log decay, <= 0).
        v: [batch, num_heads, head_v_dim] float.
        beta: [batch, num_heads] float in [0, 1].
        recurrent_state: [num_slots, num_heads, head_k_dim, head_v_dim] fp32 (or bf16; the math
            runs in fp32 and the result is stored in its dtype). Rows ``state_indices[i] >= 0``
            are read and overwritten in place; no other row is touched.
        state_indices: [batch] int32 slot of each sequence; ``< 0`` skips the sequence (its
            output row is zeros). Non-negative entries must be distinct.
        scale, use_qk_l2norm: as in :func:`kda_chunk_prefill`.

    Returns:
        o [batch, num_heads, head_v_dim] in q's dtype.

    Example:
        >>> S = torch.zeros(3, 2, 4, 4)
        >>> o = kda_recurrent_decode(torch.randn(2, 2, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4),
        ...                          -torch.rand(2, 2, 4), torch.rand(2, 2), S, torch.tensor([2, -1]))
        >>> bool(o[1].eq(0).all()), bool(S[2].ne(0).any()), bool(S[0].eq(0).all())
        (True, True, True)
    """
    qs, ks = _prepare_qk(q, k, scale, use_qk_l2norm)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], device=q.device)
    rows = torch.nonzero(state_indices >= 0).flatten()
    if rows.numel():
        slots = state_indices[rows].long()
        s = recurrent_state[slots].float() * g[rows].float().exp()[..., None]
        kr = ks[rows]
        delta = beta[rows].float()[..., None] * (v[rows].float() - torch.einsum("bhk,bhkv->bhv", kr, s))
        s = s + kr[..., None] * delta[:, :, None, :]
        out[rows] = torch.einsum("bhk,bhkv->bhv", qs[rows], s)
        recurrent_state[slots] = s.to(recurrent_state.dtype)
    return out.to(q.dtype)


def _conv_window_out(window: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """window: [dim, W - 1 + n] fp32 -> y [n, dim] fp32 (valid depthwise correlation)."""
    y = F.conv1d(window[None], weight.float()[:, None, :], None if bias is None else bias.float(),
                 groups=weight.shape[0])[0]
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(0, 1)


def _check_activation(activation) -> None:
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")


def causal_conv1d_prefill(x, weight, bias, conv_state, cu_seqlens, *, activation="silu"):
    """Depthwise causal convolution over a packed batch, each sequence continuing its conv state.

    Args:
        x: [num_tokens, dim] float, sequences packed as ``cu_seqlens`` says.
        weight: [dim, kernel_size] float (``kernel_size`` W >= 1; 4 in K3).
        bias: [dim] float or None.
        conv_state: [batch, dim, W - 1] float, the W - 1 inputs before each sequence's first new
            token, oldest first (zeros for a fresh sequence), or None for zeros. Not modified.
        cu_seqlens: [batch + 1] int32 offsets (as in :func:`kda_chunk_prefill`).
        activation: "silu" or None.

    Returns:
        ``(y, final_conv_state)``: y [num_tokens, dim] in x's dtype; final_conv_state
        [batch, dim, W - 1] in conv_state's dtype (x's without one): the last W - 1 inputs of
        each sequence, taken from its old state where it has fewer new tokens.

    Raises:
        ValueError: ``activation`` is not "silu" or None.
    """
    _check_activation(activation)
    dim, width = weight.shape
    bounds = [int(b) for b in cu_seqlens.tolist()]
    batch = len(bounds) - 1
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    old = (torch.zeros(batch, dim, width - 1, device=x.device) if conv_state is None else conv_state.float())
    y = torch.zeros(x.shape[0], dim, device=x.device)
    final = torch.empty(batch, dim, width - 1, device=x.device)
    for b in range(batch):
        window = torch.cat([old[b], x[bounds[b]:bounds[b + 1]].float().transpose(0, 1)], dim=1)
        if bounds[b + 1] > bounds[b]:
            y[bounds[b]:bounds[b + 1]] = _conv_window_out(window, weight, bias, activation)
        final[b] = window[:, window.shape[1] - (width - 1):]
    return y.to(x.dtype), final.to(state_dtype)


def causal_conv1d_update(x, weight, bias, conv_state, state_indices, *, activation="silu"):
    """One new input per sequence through the causal convolution, shifting its conv state in place.

    Args:
        x: [batch, dim] float, one new token per sequence.
        weight: [dim, kernel_size] float; bias: [dim] float or None.
        conv_state: [num_slots, dim, W - 1] float; rows ``state_indices[i] >= 0`` become
            ``(old[1:], x[i])`` in place; no other row is touched.
        state_indices: [batch] int32; ``< 0`` skips the sequence (output row zeros).
        activation: "silu" or None.

    Returns:
        y [batch, dim] in x's dtype.

    Raises:
        ValueError: ``activation`` is not "silu" or None.
    """
    _check_activation(activation)
    y = torch.zeros(x.shape[0], weight.shape[0], device=x.device)
    rows = torch.nonzero(state_indices >= 0).flatten()
    if rows.numel():
        slots = state_indices[rows].long()
        window = torch.cat([conv_state[slots].float(), x[rows].float()[:, :, None]], dim=2)   # [n, dim, W]
        out = (window * weight.float()).sum(-1)
        if bias is not None:
            out = out + bias.float()
        y[rows] = F.silu(out) if activation == "silu" else out
        conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    return y.to(x.dtype)
