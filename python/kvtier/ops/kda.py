"""Kimi Delta Attention (KDA) and its causal short convolution: public ops.

check -> allocate -> dispatch(backend) -> launch, as every op in :mod:`kvtier.ops`. The math and
its sources are in :mod:`kvtier.reference.kda` (the ``torch`` backend and the CPU path); the
Triton prefill runs 16-token chunks (:mod:`kvtier.triton_kernels.kda_chunked`) or, with
``chunk_size=1``, walks tokens (:mod:`kvtier.triton_kernels.kda`, which also holds the decode
step); the short conv is :mod:`kvtier.triton_kernels.kda_conv`. Token-major and varlen-packed: sequence ``b``'s new tokens
are rows ``cu_seqlens[b]:cu_seqlens[b+1]``.

Registered as ``torch.library`` ops (no backend in the schema, one kernel per device type, a
fake implementation each; ``Tensor(a!)``: written in place)::

    kda_chunk_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state,
                      Tensor cu_seqlens, float scale, int chunk_size, bool use_qk_l2norm,
                      Tensor? checkpoint_seq, Tensor? checkpoint_len) -> (Tensor o, Tensor final_state,
                                                                          Tensor checkpoint_states)
    kda_recurrent_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
                         Tensor(a!) recurrent_state, Tensor state_indices, float scale,
                         bool use_qk_l2norm) -> Tensor o
    causal_conv1d_prefill(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_state,
                          Tensor cu_seqlens, bool silu) -> (Tensor y, Tensor final_conv_state)
    causal_conv1d_update(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state,
                         Tensor state_indices, bool silu) -> Tensor y

The registered kernels check nothing about values; the functions below check shapes and dtypes
always and, with ``validate=True`` (the default, one host read), the index values. A caller that
checked a step's lengths and slots once passes ``validate=False`` in its layers.
"""

from __future__ import annotations

import torch

from kvtier.ops.checks import FLOAT_DTYPES, check_tensor
from kvtier.ops.dispatch import BackendUnavailableError, device_backend, register_backend, resolve_backend
from kvtier.reference import kda as ref

OPS = ("kda_chunk_prefill", "kda_recurrent_decode", "causal_conv1d_prefill", "causal_conv1d_update")
for _op in OPS:
    register_backend(_op, "triton")

STATE_DTYPES = (torch.float32, torch.bfloat16)
TRITON_MAX_HEAD_K_DIM = 256  # the Triton kernels hold a state tile's whole K axis in registers
_INT32 = [torch.int32]


# ---- backends ----------------------------------------------------------------------------------

def _triton_fits(head_k_dim: int) -> bool:
    return head_k_dim <= TRITON_MAX_HEAD_K_DIM


def _kernel_backend(op: str, device: torch.device, head_k_dim: int = 0) -> str:
    """The backend the registered GPU kernel runs: the device's, unless Triton cannot take the shape."""
    backend = device_backend(op, device)
    return "torch" if backend == "triton" and not _triton_fits(head_k_dim) else backend


def _prefill_impl(backend, q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size, use_qk_l2norm,
                  checkpoint_seq, checkpoint_len):
    if backend == "triton":
        from kvtier.ops import _triton_kda

        return _triton_kda.kda_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size,
                                             use_qk_l2norm, checkpoint_seq, checkpoint_len)
    return ref.kda_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale, chunk_size=chunk_size,
                                 use_qk_l2norm=use_qk_l2norm, checkpoint_seq=checkpoint_seq,
                                 checkpoint_len=checkpoint_len)


def _decode_impl(backend, q, k, v, g, beta, recurrent_state, state_indices, scale, use_qk_l2norm):
    if backend == "triton":
        from kvtier.ops import _triton_kda

        return _triton_kda.kda_recurrent_decode(q, k, v, g, beta, recurrent_state, state_indices, scale,
                                                use_qk_l2norm)
    return ref.kda_recurrent_decode(q, k, v, g, beta, recurrent_state, state_indices, scale=scale,
                                    use_qk_l2norm=use_qk_l2norm)


def _conv_prefill_impl(backend, x, weight, bias, conv_state, cu_seqlens, silu):
    if backend == "triton":
        from kvtier.ops import _triton_kda

        return _triton_kda.causal_conv1d_prefill(x, weight, bias, conv_state, cu_seqlens, silu)
    return ref.causal_conv1d_prefill(x, weight, bias, conv_state, cu_seqlens, activation="silu" if silu else None)


def _conv_update_impl(backend, x, weight, bias, conv_state, state_indices, silu):
    if backend == "triton":
        from kvtier.ops import _triton_kda

        return _triton_kda.causal_conv1d_update(x, weight, bias, conv_state, state_indices, silu)
    return ref.causal_conv1d_update(x, weight, bias, conv_state, state_indices, activation="silu" if silu else None)


# ---- torch.library ops -------------------------------------------------------------------------

@torch.library.custom_op("kvtier::kda_chunk_prefill", mutates_args=(), device_types="cpu")
def _kda_chunk_prefill_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor, scale: float,
                           chunk_size: int, use_qk_l2norm: bool, checkpoint_seq: torch.Tensor | None,
                           checkpoint_len: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _prefill_impl("torch", q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size, use_qk_l2norm,
                         checkpoint_seq, checkpoint_len)


@_kda_chunk_prefill_cpu.register_kernel("cuda")
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size, use_qk_l2norm, checkpoint_seq, checkpoint_len):
    backend = _kernel_backend("kda_chunk_prefill", q.device, q.shape[-1])
    return _prefill_impl(backend, q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size, use_qk_l2norm,
                         checkpoint_seq, checkpoint_len)


@_kda_chunk_prefill_cpu.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size, use_qk_l2norm, checkpoint_seq, checkpoint_len):
    num_heads, head_k_dim, head_v_dim = q.shape[1], q.shape[2], v.shape[2]
    n = 0 if checkpoint_seq is None else checkpoint_seq.shape[0]
    state = (num_heads, head_k_dim, head_v_dim)
    return (q.new_empty(q.shape[0], num_heads, head_v_dim),
            q.new_empty(cu_seqlens.shape[0] - 1, *state, dtype=torch.float32),
            q.new_empty(n, *state, dtype=torch.float32))


@torch.library.custom_op("kvtier::kda_recurrent_decode", mutates_args=("recurrent_state",), device_types="cpu")
def _kda_recurrent_decode_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, recurrent_state: torch.Tensor, state_indices: torch.Tensor,
                              scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    return _decode_impl("torch", q, k, v, g, beta, recurrent_state, state_indices, scale, use_qk_l2norm)


@_kda_recurrent_decode_cpu.register_kernel("cuda")
def _(q, k, v, g, beta, recurrent_state, state_indices, scale, use_qk_l2norm):
    backend = _kernel_backend("kda_recurrent_decode", q.device, q.shape[-1])
    return _decode_impl(backend, q, k, v, g, beta, recurrent_state, state_indices, scale, use_qk_l2norm)


@_kda_recurrent_decode_cpu.register_fake
def _(q, k, v, g, beta, recurrent_state, state_indices, scale, use_qk_l2norm):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("kvtier::causal_conv1d_prefill", mutates_args=(), device_types="cpu")
def _causal_conv1d_prefill_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               conv_state: torch.Tensor | None, cu_seqlens: torch.Tensor,
                               silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _conv_prefill_impl("torch", x, weight, bias, conv_state, cu_seqlens, silu)


@_causal_conv1d_prefill_cpu.register_kernel("cuda")
def _(x, weight, bias, conv_state, cu_seqlens, silu):
    backend = _kernel_backend("causal_conv1d_prefill", x.device)
    return _conv_prefill_impl(backend, x, weight, bias, conv_state, cu_seqlens, silu)


@_causal_conv1d_prefill_cpu.register_fake
def _(x, weight, bias, conv_state, cu_seqlens, silu):
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    return (x.new_empty(x.shape), x.new_empty(cu_seqlens.shape[0] - 1, weight.shape[0], weight.shape[1] - 1,
                                              dtype=state_dtype))


@torch.library.custom_op("kvtier::causal_conv1d_update", mutates_args=("conv_state",), device_types="cpu")
def _causal_conv1d_update_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              conv_state: torch.Tensor, state_indices: torch.Tensor, silu: bool) -> torch.Tensor:
    return _conv_update_impl("torch", x, weight, bias, conv_state, state_indices, silu)


@_causal_conv1d_update_cpu.register_kernel("cuda")
def _(x, weight, bias, conv_state, state_indices, silu):
    return _conv_update_impl(_kernel_backend("causal_conv1d_update", x.device), x, weight, bias, conv_state,
                             state_indices, silu)


@_causal_conv1d_update_cpu.register_fake
def _(x, weight, bias, conv_state, state_indices, silu):
    return x.new_empty(x.shape[0], weight.shape[0])


# ---- checks ------------------------------------------------------------------------------------

def _check_kda_inputs(q, k, v, g, beta, leading: str) -> tuple[int, int, int, int]:
    """Shapes, dtypes and devices of q/k/v/g/beta; returns (rows, num_heads, head_k_dim, head_v_dim)."""
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    rows, num_heads, head_k_dim = q.shape
    dev = q.device
    check_tensor(k, "k", shape=[rows, num_heads, head_k_dim], dtypes=[q.dtype], device=dev)
    check_tensor(g, "g", shape=[rows, num_heads, head_k_dim], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(v, "v", shape=[rows, num_heads, None], dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(beta, "beta", shape=[rows, num_heads], dtypes=FLOAT_DTYPES, device=dev)
    if head_k_dim == 0 or v.shape[2] == 0:
        raise ValueError(f"head_k_dim and head_v_dim must be >= 1 ({leading} q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)})")
    return rows, num_heads, head_k_dim, v.shape[2]


def _check_cu_seqlens(cu_seqlens, num_tokens: int, device, validate: bool) -> int:
    check_tensor(cu_seqlens, "cu_seqlens", ndim=1, dtypes=_INT32, device=device)
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must have shape (batch + 1,) with batch >= 0, got (0,)")
    if validate:
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != num_tokens or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at num_tokens={num_tokens}, "
                             f"got {cu if len(cu) <= 16 else cu[:8] + ['...'] + cu[-4:]}")
    return cu_seqlens.numel() - 1


def _check_slots(state_indices, batch: int, num_slots: int, device, validate: bool) -> None:
    check_tensor(state_indices, "state_indices", shape=[batch], dtypes=_INT32, device=device)
    if validate and batch:
        used = state_indices[state_indices >= 0]
        if used.numel() and int(used.max()) >= num_slots:
            raise ValueError(f"state_indices must be < num_slots={num_slots} (or < 0 to skip), "
                             f"got max {int(used.max())}")
        if torch.unique(used).numel() != used.numel():
            raise ValueError("state_indices must be distinct where >= 0 (a slot updated twice in one step is "
                             f"ambiguous), got {state_indices.tolist()}")


def _check_checkpoints(checkpoint_seq, checkpoint_len, cu_seqlens, device, validate: bool) -> None:
    if (checkpoint_seq is None) != (checkpoint_len is None):
        raise ValueError("checkpoint_seq and checkpoint_len must be given together (both or neither)")
    if checkpoint_seq is None:
        return
    check_tensor(checkpoint_seq, "checkpoint_seq", ndim=1, dtypes=_INT32, device=device)
    check_tensor(checkpoint_len, "checkpoint_len", shape=[checkpoint_seq.shape[0]], dtypes=_INT32, device=device)
    if validate and checkpoint_seq.numel():
        ref._checkpoints_by_seq(checkpoint_seq, checkpoint_len, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist())


def _resolve(op: str, backend: str, device, dtype, head_k_dim: int = 0) -> str:
    resolved = resolve_backend(op, backend, device, dtype)
    if resolved == "triton" and not _triton_fits(head_k_dim):
        if backend == "auto":
            return "torch"
        raise BackendUnavailableError(f"{op}: backend 'triton' takes head_k_dim <= {TRITON_MAX_HEAD_K_DIM}, "
                                      f"got {head_k_dim}")
    return resolved


def _scale(scale, head_k_dim: int) -> float:
    return head_k_dim ** -0.5 if scale is None else float(scale)


# ---- public ops --------------------------------------------------------------------------------

def kda_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens, *, scale=None, chunk_size=64, use_qk_l2norm=True,
                      checkpoint_seq=None, checkpoint_len=None, validate=True, backend="auto"):
    """KDA over a packed batch of new tokens from given states, with states at chosen tokens out.

    Args:
        q, k: [num_tokens, num_heads, head_k_dim] fp32/bf16/fp16 (k in q's dtype). Heads and dims
            contiguous; the token stride may be anything (views of a fused projection are fine).
        v: [num_tokens, num_heads, head_v_dim] float.
        g: [num_tokens, num_heads, head_k_dim] float, per-channel log decay (<= 0), already through
            the gate activation and its lower bound.
        beta: [num_tokens, num_heads] float in [0, 1] (already sigmoid-ed).
        initial_state: [batch, num_heads, head_k_dim, head_v_dim] fp32 (or bf16) state before each
            sequence's new tokens, or None for zeros. Not modified.
        cu_seqlens: [batch + 1] int32 offsets, 0 first, non-decreasing, num_tokens last.
        scale: query scale, default ``head_k_dim ** -0.5``.
        chunk_size: tokens per chunk of the chunked form (>= 1; changes rounding only). Triton: 1
            walks tokens one by one (fp32 math throughout); larger values run 16-token chunks whose
            matrix products take bf16/fp16 operands for bf16/fp16 inputs on a GPU (fp32 accumulation,
            states kept in fp32).
        use_qk_l2norm: l2-normalise q and k over head_k_dim inside (K3 does).
        checkpoint_seq, checkpoint_len: [n] int32 each or None (both or neither): row i is the state
            of sequence ``checkpoint_seq[i]`` after its first ``checkpoint_len[i]`` new tokens
            (0 = its initial state).
        validate: check cu_seqlens and the checkpoint values (one host read); False skips it.
        backend: "auto" | "torch" | "triton" (:mod:`kvtier.ops.dispatch`).

    Returns:
        ``(o, final_state, checkpoint_states)``: o [num_tokens, num_heads, head_v_dim] in q's dtype;
        final_state [batch, num_heads, head_k_dim, head_v_dim] fp32; checkpoint_states
        [n, num_heads, head_k_dim, head_v_dim] fp32.

    Raises:
        TypeError / ValueError: a misshaped or mistyped argument, bad cu_seqlens, a checkpoint out of
            range (the message names the argument, expected vs got).
        BackendUnavailableError: ``backend`` cannot run here (e.g. "triton" with head_k_dim > 256).
    """
    with torch.profiler.record_function("kvtier::kda_chunk_prefill"):
        num_tokens, num_heads, head_k_dim, head_v_dim = _check_kda_inputs(q, k, v, g, beta, "prefill")
        dev = q.device
        batch = _check_cu_seqlens(cu_seqlens, num_tokens, dev, validate)
        if initial_state is not None:
            check_tensor(initial_state, "initial_state", shape=[batch, num_heads, head_k_dim, head_v_dim],
                         dtypes=STATE_DTYPES, device=dev)
        _check_checkpoints(checkpoint_seq, checkpoint_len, cu_seqlens, dev, validate)
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        resolved = _resolve("kda_chunk_prefill", backend, dev, q.dtype, head_k_dim)
        args = (q, k, v, g, beta, initial_state, cu_seqlens, _scale(scale, head_k_dim), chunk_size,
                bool(use_qk_l2norm), checkpoint_seq, checkpoint_len)
        if resolved == _kernel_backend("kda_chunk_prefill", dev, head_k_dim):
            return tuple(torch.ops.kvtier.kda_chunk_prefill(*args))
        return _prefill_impl(resolved, *args)


def kda_recurrent_decode(q, k, v, g, beta, recurrent_state, state_indices, *, scale=None, use_qk_l2norm=True,
                         validate=True, backend="auto"):
    """One KDA token per sequence against its state slot, updated in place.

    Args:
        q, k, g: [batch, num_heads, head_k_dim] float (k in q's dtype; g the log decay, <= 0).
        v: [batch, num_heads, head_v_dim] float; beta: [batch, num_heads] float in [0, 1].
        recurrent_state: [num_slots, num_heads, head_k_dim, head_v_dim] fp32 (or bf16), contiguous;
            rows ``state_indices[i] >= 0`` are read and overwritten, no other row is touched.
        state_indices: [batch] int32 slot per sequence, distinct where >= 0; < 0 skips the sequence
            (its o row is zeros).
        scale, use_qk_l2norm: as in :func:`kda_chunk_prefill`.
        validate: check the slot values (one host read); False skips it.
        backend: "auto" | "torch" | "triton".

    Returns:
        o [batch, num_heads, head_v_dim] in q's dtype.

    Raises:
        TypeError / ValueError: a misshaped or mistyped argument, a slot out of range or repeated.
        BackendUnavailableError: ``backend`` cannot run here.
    """
    with torch.profiler.record_function("kvtier::kda_recurrent_decode"):
        batch, num_heads, head_k_dim, head_v_dim = _check_kda_inputs(q, k, v, g, beta, "decode")
        dev = q.device
        check_tensor(recurrent_state, "recurrent_state", shape=[None, num_heads, head_k_dim, head_v_dim],
                     dtypes=STATE_DTYPES, device=dev)
        if not recurrent_state.is_contiguous():
            raise ValueError("recurrent_state must be contiguous (it is updated in place), got strides "
                             f"{recurrent_state.stride()}")
        _check_slots(state_indices, batch, recurrent_state.shape[0], dev, validate)
        resolved = _resolve("kda_recurrent_decode", backend, dev, q.dtype, head_k_dim)
        args = (q, k, v, g, beta, recurrent_state, state_indices, _scale(scale, head_k_dim), bool(use_qk_l2norm))
        if resolved == _kernel_backend("kda_recurrent_decode", dev, head_k_dim):
            return torch.ops.kvtier.kda_recurrent_decode(*args)
        return _decode_impl(resolved, *args)


def _check_conv(x, weight, bias, activation) -> bool:
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    dim = x.shape[1]
    check_tensor(weight, "weight", ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    if weight.shape[0] != dim or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape ({dim}, kernel_size >= 1), got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor(bias, "bias", shape=[dim], dtypes=FLOAT_DTYPES, device=x.device)
    if activation not in ref.CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {ref.CONV_ACTIVATIONS}, got {activation!r}")
    if x.shape[0] and x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dim, got strides {x.stride()}")
    return activation == "silu"


def causal_conv1d_prefill(x, weight, bias, conv_state, cu_seqlens, *, activation="silu", validate=True,
                          backend="auto"):
    """Depthwise causal convolution of a packed batch, each sequence continuing its conv state.

    Args:
        x: [num_tokens, dim] fp32/bf16/fp16, last dim contiguous (any token stride).
        weight: [dim, kernel_size] float (kernel_size W >= 1; 4 in K3); bias: [dim] float or None.
        conv_state: [batch, dim, W - 1] float, each sequence's previous W - 1 inputs, oldest first
            (zeros for a fresh sequence), or None for zeros. Not modified.
        cu_seqlens: [batch + 1] int32 offsets (as in :func:`kda_chunk_prefill`).
        activation: "silu" or None.
        validate: check cu_seqlens' values (one host read); False skips it.
        backend: "auto" | "torch" | "triton".

    Returns:
        ``(y, final_conv_state)``: y [num_tokens, dim] in x's dtype; final_conv_state
        [batch, dim, W - 1] in conv_state's dtype (x's without one): the last W - 1 inputs of each
        sequence, left-filled from its old state when it has fewer new tokens.

    Raises:
        TypeError / ValueError: a misshaped or mistyped argument, bad cu_seqlens, an unknown activation.
        BackendUnavailableError: ``backend`` cannot run here.
    """
    with torch.profiler.record_function("kvtier::causal_conv1d_prefill"):
        silu = _check_conv(x, weight, bias, activation)
        batch = _check_cu_seqlens(cu_seqlens, x.shape[0], x.device, validate)
        if conv_state is not None:
            check_tensor(conv_state, "conv_state", shape=[batch, x.shape[1], weight.shape[1] - 1],
                         dtypes=FLOAT_DTYPES, device=x.device)
        resolved = _resolve("causal_conv1d_prefill", backend, x.device, x.dtype)
        args = (x, weight, bias, conv_state, cu_seqlens, silu)
        if resolved == _kernel_backend("causal_conv1d_prefill", x.device):
            return tuple(torch.ops.kvtier.causal_conv1d_prefill(*args))
        return _conv_prefill_impl(resolved, *args)


def causal_conv1d_update(x, weight, bias, conv_state, state_indices, *, activation="silu", validate=True,
                         backend="auto"):
    """One new input per sequence through the causal convolution; its slot's window shifts in place.

    Args:
        x: [batch, dim] float, last dim contiguous.
        weight: [dim, kernel_size] float; bias: [dim] float or None.
        conv_state: [num_slots, dim, W - 1] float, contiguous; rows ``state_indices[i] >= 0`` become
            ``(old[:, 1:], x[i])``; no other row is touched.
        state_indices: [batch] int32, distinct where >= 0; < 0 skips the sequence (y row zeros).
        activation: "silu" or None.
        validate: check the slot values (one host read); False skips it.
        backend: "auto" | "torch" | "triton".

    Returns:
        y [batch, dim] in x's dtype.

    Raises:
        TypeError / ValueError: a misshaped or mistyped argument, a slot out of range or repeated.
        BackendUnavailableError: ``backend`` cannot run here.
    """
    with torch.profiler.record_function("kvtier::causal_conv1d_update"):
        silu = _check_conv(x, weight, bias, activation)
        check_tensor(conv_state, "conv_state", shape=[None, x.shape[1], weight.shape[1] - 1], dtypes=FLOAT_DTYPES,
                     device=x.device)
        if not conv_state.is_contiguous():
            raise ValueError(f"conv_state must be contiguous (it is updated in place), got strides "
                             f"{conv_state.stride()}")
        _check_slots(state_indices, x.shape[0], conv_state.shape[0], x.device, validate)
        resolved = _resolve("causal_conv1d_update", backend, x.device, x.dtype)
        args = (x, weight, bias, conv_state, state_indices, silu)
        if resolved == _kernel_backend("causal_conv1d_update", x.device):
            return torch.ops.kvtier.causal_conv1d_update(*args)
        return _conv_update_impl(resolved, *args)
