"""KDA and the causal short conv: the fp32 references against transformers' KimiLinear pure-torch
fallback and fla-core's naive KDA, and against themselves (chunked == recurrent token by token,
state carried across chunk and request boundaries, interior checkpoints == the prefix alone,
mixed-length batches with empty and one-token sequences, the gate at K3's lower bound)."""

from __future__ import annotations

import pytest
import torch

from kvtier.reference import kda as ref
from tests.ops._compare import assert_close

GATE_LOWER_BOUND = -5.0  # K3's linear_attn_config.gate_lower_bound


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _cu(lengths) -> torch.Tensor:
    return _i32([0, *torch.tensor(lengths).cumsum(0).tolist()]) if lengths else _i32([0])


def kda_inputs(num_tokens, num_heads, head_k_dim, head_v_dim, dtype=torch.float32, *, seed=0, gate="random"):
    """q, k, v, g, beta as the model hands them over: g <= 0 (lower-bound gate), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_k_dim, generator=gen)
    k = torch.randn(num_tokens, num_heads, head_k_dim, generator=gen)
    v = torch.randn(num_tokens, num_heads, head_v_dim, generator=gen)
    if gate == "lower_bound":
        g = torch.full((num_tokens, num_heads, head_k_dim), GATE_LOWER_BOUND)
    elif gate == "strong":  # far past K3's bound: exp(g) underflows, a factored exp(G_t) * exp(-G_j) overflows
        g = -200.0 * torch.rand(num_tokens, num_heads, head_k_dim, generator=gen)
    else:  # lower_bound * sigmoid(x): K3's gate activation, spread over (-5, 0)
        g = GATE_LOWER_BOUND * torch.sigmoid(torch.randn(num_tokens, num_heads, head_k_dim, generator=gen) * 2 - 3)
    beta = torch.sigmoid(torch.randn(num_tokens, num_heads, generator=gen))
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def random_state(batch, num_heads, head_k_dim, head_v_dim, *, seed=1):
    return torch.randn(batch, num_heads, head_k_dim, head_v_dim, generator=torch.Generator().manual_seed(seed)) * 0.5


def _transformers_kda():
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


# dtype -> (atol, rtol) on o (in the input dtype) and on the fp32 state
REF_TOL = [
    pytest.param(torch.float32, 2e-5, 1e-5, 2e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1.6e-2, 1e-2, 2e-5, id="bf16"),
]


@pytest.mark.parametrize("dtype, o_atol, o_rtol, s_atol", REF_TOL)
@pytest.mark.parametrize("num_tokens, chunk_size", [(1, 16), (16, 16), (37, 16), (70, 64)])
@pytest.mark.parametrize("gate", ["random", "lower_bound"])
def test_prefill_matches_transformers_kimi_linear(dtype, o_atol, o_rtol, s_atol, num_tokens, chunk_size, gate):
    tf = _transformers_kda()
    H, K, V = 2, 16, 12
    q, k, v, g, beta = kda_inputs(num_tokens, H, K, V, dtype, seed=num_tokens, gate=gate)
    s0 = random_state(1, H, K, V)
    o, s, ckpt = ref.kda_chunk_prefill(q, k, v, g, beta, s0, _cu([num_tokens]), chunk_size=chunk_size)
    assert o.dtype == dtype and s.dtype == torch.float32 and ckpt.shape == (0, H, K, V)
    args = (q[None], k[None], v[None], g[None], beta[None])
    o_chunk, s_chunk = tf.chunk_kimi_delta_attention(*args, chunk_size=chunk_size, initial_state=s0,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_rec, s_rec = tf.recurrent_kimi_delta_attention(*args, s0, True, use_qk_l2norm_in_kernel=True)
    for name, o_want, s_want in (("chunk", o_chunk, s_chunk), ("recurrent", o_rec, s_rec)):
        assert_close(o, o_want[0], atol=o_atol, rtol=o_rtol, name=f"o vs transformers {name}")
        assert_close(s, s_want, atol=s_atol, rtol=1e-5, name=f"state vs transformers {name}")


@pytest.mark.parametrize("num_tokens", [5, 32])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_prefill_matches_fla_naive_kda(num_tokens, scale):
    naive = pytest.importorskip("fla.ops.kda.naive")
    H, K, V = 3, 8, 16
    q, k, v, g, beta = kda_inputs(num_tokens, H, K, V, seed=7)
    s0 = random_state(1, H, K, V, seed=3)
    o, s, _ = ref.kda_chunk_prefill(q, k, v, g, beta, s0, _cu([num_tokens]), scale=scale, chunk_size=16)
    # fla's naive KDA takes q and k already normalised (its kernels do it with use_qk_l2norm_in_kernel)
    args = (ref.l2norm(q)[None], ref.l2norm(k)[None], v[None], g[None], beta[None])
    o_rec, s_rec = naive.naive_recurrent_kda(*args, scale=scale, initial_state=s0, output_final_state=True)
    assert_close(o, o_rec[0], atol=2e-5, rtol=1e-5, name="o vs fla naive_recurrent_kda")
    assert_close(s, s_rec, atol=2e-5, rtol=1e-5, name="state vs fla naive_recurrent_kda")
    if num_tokens % 16 == 0:  # naive_chunk_kda takes whole chunks only
        o_ch, s_ch = naive.naive_chunk_kda(*args, scale=scale, initial_state=s0, output_final_state=True,
                                           chunk_size=16)
        assert_close(o, o_ch[0], atol=2e-5, rtol=1e-5, name="o vs fla naive_chunk_kda")
        assert_close(s, s_ch, atol=2e-5, rtol=1e-5, name="state vs fla naive_chunk_kda")


@pytest.mark.parametrize("gate", ["random", "lower_bound"])
def test_chunked_prefill_equals_recurrent_decode_token_by_token(gate):
    H, K, V, T = 2, 16, 8, 23
    q, k, v, g, beta = kda_inputs(T, H, K, V, seed=11, gate=gate)
    s0 = random_state(1, H, K, V)
    o, s, _ = ref.kda_chunk_prefill(q, k, v, g, beta, s0, _cu([T]), chunk_size=8)
    slots = torch.full((3, H, K, V), float("nan"))
    slots[1] = s0[0]
    steps = [ref.kda_recurrent_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], slots,
                                      _i32([1])) for t in range(T)]
    assert_close(o, torch.cat(steps), atol=2e-5, rtol=1e-5, name="o chunked vs token by token")
    assert_close(s[0], slots[1], atol=2e-5, rtol=1e-5, name="state chunked vs token by token")
    assert torch.isnan(slots[[0, 2]]).all(), "decode touched a slot it was not given"


@pytest.mark.parametrize("cuts", [(5, 19), (16, 32), (1, 2)])
def test_prefill_in_three_pieces_carrying_state_equals_one_prefill(cuts):
    H, K, V, T = 2, 16, 8, 41
    q, k, v, g, beta = kda_inputs(T, H, K, V, seed=5)
    s0 = random_state(1, H, K, V)
    o, s, _ = ref.kda_chunk_prefill(q, k, v, g, beta, s0, _cu([T]), chunk_size=16)
    state, pieces = s0, []
    for lo, hi in zip((0, *cuts), (*cuts, T)):
        part = [x[lo:hi] for x in (q, k, v, g, beta)]
        o_part, state, _ = ref.kda_chunk_prefill(*part, state, _cu([hi - lo]), chunk_size=16)
        pieces.append(o_part)
    assert_close(torch.cat(pieces), o, atol=2e-5, rtol=1e-5, name="o in pieces")
    assert_close(state, s, atol=2e-5, rtol=1e-5, name="final state in pieces")


def test_mixed_length_batch_equals_each_sequence_alone():
    H, K, V = 2, 16, 8
    lengths = [7, 0, 1, 33, 16]
    q, k, v, g, beta = kda_inputs(sum(lengths), H, K, V, seed=9)
    s0 = random_state(len(lengths), H, K, V)
    cu = _cu(lengths)
    o, s, _ = ref.kda_chunk_prefill(q, k, v, g, beta, s0, cu, chunk_size=16)
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [x[lo:hi] for x in (q, k, v, g, beta)]
        o_b, s_b, _ = ref.kda_chunk_prefill(*part, s0[b:b + 1], _cu([hi - lo]), chunk_size=16)
        assert_close(o[lo:hi], o_b, atol=2e-5, rtol=1e-5, name=f"o of sequence {b}")
        assert_close(s[b], s_b[0], atol=2e-5, rtol=1e-5, name=f"state of sequence {b}")
    assert torch.equal(s[1], s0[1]), "an empty sequence's final state is its initial state"


def test_checkpoint_states_equal_running_the_prefix_alone():
    H, K, V = 2, 16, 8
    lengths = [37, 0, 20]
    q, k, v, g, beta = kda_inputs(sum(lengths), H, K, V, seed=13)
    s0 = random_state(len(lengths), H, K, V)
    cu = _cu(lengths)
    seq, pos = [0, 0, 2, 0, 1, 2, 0, 2], [16, 5, 0, 37, 0, 20, 5, 13]  # interior, chunk edge, 0, end, repeats
    o, s, ckpt = ref.kda_chunk_prefill(q, k, v, g, beta, s0, cu, chunk_size=16, checkpoint_seq=_i32(seq),
                                       checkpoint_len=_i32(pos))
    o_plain, s_plain, _ = ref.kda_chunk_prefill(q, k, v, g, beta, s0, cu, chunk_size=16)
    assert_close(o, o_plain, atol=2e-5, rtol=1e-5, name="o with checkpoints")
    assert_close(s, s_plain, atol=2e-5, rtol=1e-5, name="final state with checkpoints")
    assert ckpt.shape == (len(seq), H, K, V) and ckpt.dtype == torch.float32
    for row, (b, n) in enumerate(zip(seq, pos)):
        lo = int(cu[b])
        part = [x[lo:lo + n] for x in (q, k, v, g, beta)]
        _, want, _ = ref.kda_chunk_prefill(*part, s0[b:b + 1], _cu([n]), chunk_size=16)
        assert_close(ckpt[row], want[0], atol=2e-5, rtol=1e-5, name=f"checkpoint {row} (seq {b}, {n} tokens)")


@pytest.mark.parametrize("seq, pos, match", [
    ([3], [0], r"checkpoint_seq\[0\] must be in \[0, batch=2\)"),
    ([1], [6], r"checkpoint_len\[0\] must be in \[0, 5\]"),
])
def test_checkpoint_out_of_range_is_an_error(seq, pos, match):
    q, k, v, g, beta = kda_inputs(9, 1, 4, 4)
    with pytest.raises(ValueError, match=match):
        ref.kda_chunk_prefill(q, k, v, g, beta, None, _cu([4, 5]), checkpoint_seq=_i32(seq),
                              checkpoint_len=_i32(pos))


def test_recurrent_decode_matches_transformers_and_skips_negative_slots():
    tf = _transformers_kda()
    H, K, V = 2, 16, 8
    q, k, v, g, beta = kda_inputs(4, H, K, V, seed=21)
    states = random_state(6, H, K, V)
    before = states.clone()
    idx = _i32([4, -1, 0, 2])
    o = ref.kda_recurrent_decode(q, k, v, g, beta, states, idx)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.equal(states[[1, 3, 5]], before[[1, 3, 5]])
    for row, slot in ((0, 4), (2, 0), (3, 2)):
        o_tf, s_tf = tf.recurrent_kimi_delta_attention(q[None, row:row + 1], k[None, row:row + 1],
                                                       v[None, row:row + 1], g[None, row:row + 1],
                                                       beta[None, row:row + 1], before[slot:slot + 1], True,
                                                       use_qk_l2norm_in_kernel=True)
        assert_close(o[row], o_tf[0, 0], atol=2e-6, rtol=1e-5, name=f"o of row {row}")
        assert_close(states[slot], s_tf[0], atol=2e-6, rtol=1e-5, name=f"slot {slot}")


# ---- causal short conv -------------------------------------------------------------------------

def conv_inputs(num_tokens, dim, width, batch, dtype=torch.float32, *, seed=0, with_bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, dim, generator=gen).to(dtype)
    weight = (torch.randn(dim, width, generator=gen) * 0.5).to(dtype)
    bias = (torch.randn(dim, generator=gen) * 0.1).to(dtype) if with_bias else None
    state = torch.randn(batch, dim, width - 1, generator=gen).to(dtype)
    return x, weight, bias, state


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("num_tokens", [1, 2, 9])
def test_conv_prefill_matches_transformers(activation, num_tokens):
    tf = _transformers_kda()
    dim, width = 12, 4
    x, weight, bias, state = conv_inputs(num_tokens, dim, width, 1, seed=num_tokens)
    y, final = ref.causal_conv1d_prefill(x, weight, bias, state, _cu([num_tokens]), activation=activation)
    window = torch.cat([state, x.T[None]], dim=2)
    want = tf.causal_conv1d_fn(window, weight, bias, activation=activation)[:, :, -num_tokens:]
    assert_close(y, want[0].T, atol=1e-6, rtol=1e-6, name="conv y")
    want_state = state.clone()
    want_y = tf.causal_conv1d_update(x.T[None], want_state, weight, bias, activation=activation)
    assert_close(y, want_y[0].T, atol=1e-6, rtol=1e-6, name="conv y vs update form")
    assert torch.equal(final, want_state)


def test_conv_mixed_batch_pieces_and_token_updates_agree():
    dim, width = 10, 4
    lengths = [5, 0, 1, 2, 8]
    x, weight, bias, state = conv_inputs(sum(lengths), dim, width, len(lengths), seed=3)
    cu = _cu(lengths)
    y, final = ref.causal_conv1d_prefill(x, weight, bias, state, cu)
    assert torch.equal(final[1], state[1]) and torch.equal(final[2], torch.cat([state[2, :, 1:], x[5:6].T], 1))
    slots = torch.full((7, dim, width - 1), float("nan"))
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        slots[b + 2] = state[b]
        steps = [ref.causal_conv1d_update(x[t:t + 1], weight, bias, slots, _i32([b + 2])) for t in range(lo, hi)]
        if steps:
            assert_close(torch.cat(steps), y[lo:hi], atol=1e-6, rtol=1e-6, name=f"conv updates of sequence {b}")
        assert torch.equal(slots[b + 2], final[b])
        # the same sequence in two pieces, carrying the conv state
        mid = (lo + hi) // 2
        y1, s1 = ref.causal_conv1d_prefill(x[lo:mid], weight, bias, state[b:b + 1], _cu([mid - lo]))
        y2, s2 = ref.causal_conv1d_prefill(x[mid:hi], weight, bias, s1, _cu([hi - mid]))
        assert_close(torch.cat([y1, y2]), y[lo:hi], atol=1e-6, rtol=1e-6, name=f"conv pieces of sequence {b}")
        assert torch.equal(s2[0], final[b])
    assert torch.isnan(slots[[0, 1]]).all()


def test_conv_update_skips_negative_slots_and_fresh_state_is_zero_padding():
    dim, width = 6, 4
    x, weight, bias, _ = conv_inputs(3, dim, width, 1, seed=4)
    y, final = ref.causal_conv1d_prefill(x, weight, None, None, _cu([3]))
    padded = torch.cat([torch.zeros(width - 1, dim), x])
    want = torch.nn.functional.silu(torch.stack([(padded[t:t + width].T * weight).sum(-1) for t in range(3)]))
    assert_close(y, want, atol=1e-6, rtol=1e-6, name="conv from zeros")
    assert torch.equal(final[0], x.T)
    slots = torch.ones(2, dim, width - 1)
    out = ref.causal_conv1d_update(x[:2], weight, bias, slots, _i32([-1, 0]))
    assert torch.equal(out[0], torch.zeros(dim)) and torch.equal(slots[1], torch.ones(dim, width - 1))
    with pytest.raises(ValueError, match="activation must be one of"):
        ref.causal_conv1d_update(x[:2], weight, bias, slots, _i32([0, 1]), activation="gelu")


# ---- the ops: Triton kernels under the interpreter, registered ops, checks -----------------------

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# dtype of q/k/v/beta -> tolerances on o (in that dtype) and on the fp32 states; g stays fp32 as the
# gate hands it over. Both sides upcast the same bf16 values, so the states agree to fp32 rounding.
TRITON_TOL = [
    pytest.param(torch.float32, 3e-5, 1e-5, 3e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1.6e-2, 1e-2, 3e-5, id="bf16"),
]


def _kda_case(lengths, dtype, *, seed, gate="random", H=2, K=16, V=16):
    q, k, v, g, beta = kda_inputs(sum(lengths), H, K, V, seed=seed, gate=gate)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)], random_state(len(lengths), H, K, V, seed=seed)


@pytest.mark.usefixtures("_interpreter")
@pytest.mark.parametrize("chunk_size", [1, 64], ids=["token-walk", "chunked"])
@pytest.mark.parametrize("dtype, o_atol, o_rtol, s_atol", TRITON_TOL)
@pytest.mark.parametrize("lengths, gate, with_state", [
    ((17,), "random", True),          # not a multiple of the chunk
    ((7, 0, 1, 20), "random", True),  # mixed lengths with an empty and a one-token sequence
    ((16, 5), "lower_bound", False),  # the gate at K3's lower bound, fresh sequences
    ((33,), "strong", True),          # decays far stronger than any gate makes
])
def test_triton_prefill_matches_reference(chunk_size, dtype, o_atol, o_rtol, s_atol, lengths, gate, with_state):
    from kvtier import ops

    inputs, s0 = _kda_case(lengths, dtype, seed=len(lengths) * 7, gate=gate)
    s0 = s0 if with_state else None
    cu = _cu(list(lengths))
    seqs = [b for b, n in enumerate(lengths) for _ in range(2)]
    poss = [p for n in lengths for p in (n // 2, n)]  # an interior token and the end of each sequence
    ck = dict(checkpoint_seq=_i32(seqs), checkpoint_len=_i32(poss))
    o, s, c = ops.kda_chunk_prefill(*inputs, s0, cu, chunk_size=chunk_size, backend="triton", **ck)
    o_ref, s_ref, c_ref = ref.kda_chunk_prefill(*inputs, s0, cu, chunk_size=16, **ck)
    assert o.dtype == dtype and s.dtype == torch.float32 and c.dtype == torch.float32
    assert_close(o, o_ref, atol=o_atol, rtol=o_rtol, name="o", max_cos_diff=1e-4)
    assert_close(s, s_ref, atol=s_atol, rtol=1e-5, name="final_state")
    assert_close(c, c_ref, atol=s_atol, rtol=1e-5, name="checkpoint_states")


@pytest.mark.usefixtures("_interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_state_carried_across_chunk_and_request_boundaries(dtype):
    """One request of 37 tokens == three requests (16 + 9 + 11 tokens, the state carried in fp32) ==
    the first two as prefills and the last 11 as Triton decode steps on a state slot."""
    from kvtier import ops

    (q, k, v, g, beta), s0 = _kda_case([37], dtype, seed=3)
    o_ref, s_ref, _ = ref.kda_chunk_prefill(q, k, v, g, beta, s0, _cu([37]), chunk_size=16)
    state, pieces = s0, []
    for lo, hi in ((0, 16), (16, 25)):
        o_p, state, _ = ops.kda_chunk_prefill(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state,
                                              _cu([hi - lo]), backend="triton")
        pieces.append(o_p)
    slots = torch.full((3, *state.shape[1:]), float("nan"))
    slots[2] = state[0]
    for t in range(25, 37):
        sl = slice(t, t + 1)
        pieces.append(ops.kda_recurrent_decode(q[sl], k[sl], v[sl], g[sl], beta[sl], slots, _i32([2]),
                                               backend="triton"))
    tol = 1.6e-2 if dtype == torch.bfloat16 else 3e-5
    assert_close(torch.cat(pieces), o_ref, atol=tol, rtol=1e-2, name="o across requests")
    assert_close(slots[2], s_ref[0], atol=5e-5, rtol=1e-5, name="state after the last decode")
    assert torch.isnan(slots[:2]).all()


@pytest.mark.usefixtures("_interpreter")
@pytest.mark.parametrize("state_dtype, s_atol", [(torch.float32, 3e-5), (torch.bfloat16, 2e-2)],
                         ids=["fp32-state", "bf16-state"])
@pytest.mark.parametrize("gate", ["random", "lower_bound"])
def test_triton_decode_matches_reference_and_skips_negative_slots(state_dtype, s_atol, gate):
    from kvtier import ops

    (q, k, v, g, beta), _ = _kda_case([4], torch.bfloat16, seed=5, gate=gate, V=24)
    slots = random_state(6, 2, 16, 24, seed=2).to(state_dtype)
    want_slots = slots.clone()
    idx = _i32([5, -1, 0, 3])
    o = ops.kda_recurrent_decode(q, k, v, g, beta, slots, idx, backend="triton")
    o_ref = ref.kda_recurrent_decode(q, k, v, g, beta, want_slots, idx)
    assert o.dtype == torch.bfloat16 and torch.equal(o[1], torch.zeros_like(o[1]))
    assert_close(o, o_ref, atol=1.6e-2, rtol=1e-2, name="o")
    assert_close(slots.float(), want_slots.float(), atol=s_atol, rtol=1e-2, name="slots")
    assert torch.equal(slots[[1, 2, 4]], want_slots[[1, 2, 4]]), "untouched slots changed"


@pytest.mark.usefixtures("_interpreter")
def test_triton_kda_takes_views_of_a_fused_projection():
    """q, k, v as column slices of one [tokens, 3 * H * K] tensor (token stride 3 * H * K)."""
    from kvtier import ops

    H, K, T = 2, 16, 9
    fused = torch.randn(T, 3 * H * K, generator=torch.Generator().manual_seed(4))
    q, k, v = (fused[:, i * H * K:(i + 1) * H * K].view(T, H, K) for i in range(3))
    _, _, _, g, beta = kda_inputs(T, H, K, K, seed=4)
    o, s, _ = ops.kda_chunk_prefill(q, k, v, g, beta, None, _cu([4, 5]), backend="triton")
    o_ref, s_ref, _ = ref.kda_chunk_prefill(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, None,
                                            _cu([4, 5]))
    assert_close(o, o_ref, atol=3e-5, rtol=1e-5, name="o from views")
    assert_close(s, s_ref, atol=3e-5, rtol=1e-5, name="state from views")
    slots = torch.zeros(2, H, K, K)
    want = slots.clone()
    o = ops.kda_recurrent_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], slots, _i32([1, 0]), backend="triton")
    assert_close(o, ref.kda_recurrent_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], want, _i32([1, 0])),
                 atol=3e-5, rtol=1e-5, name="decode o from views")


CONV_TOL = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 1.6e-2, id="bf16")]


@pytest.mark.usefixtures("_interpreter")
@pytest.mark.parametrize("dtype, atol", CONV_TOL)
@pytest.mark.parametrize("lengths, with_state, with_bias, activation", [
    ((5, 0, 1, 2, 19), True, True, "silu"),
    ((3,), False, False, None),
    ((1, 1), True, False, "silu"),
])
def test_triton_conv_prefill_matches_reference(dtype, atol, lengths, with_state, with_bias, activation):
    from kvtier import ops

    dim = 20
    x, weight, bias, state = conv_inputs(sum(lengths), dim, 4, len(lengths), dtype, seed=sum(lengths),
                                         with_bias=with_bias)
    state = state if with_state else None
    wide = torch.zeros(x.shape[0], dim + 6, dtype=dtype)
    wide[:, 3:3 + dim] = x
    x_view = wide[:, 3:3 + dim]  # token stride dim + 6
    cu = _cu(list(lengths))
    y, final = ops.causal_conv1d_prefill(x_view, weight, bias, state, cu, activation=activation, backend="triton")
    y_ref, final_ref = ref.causal_conv1d_prefill(x, weight, bias, state, cu, activation=activation)
    assert y.dtype == dtype and final.dtype == final_ref.dtype
    assert_close(y, y_ref, atol=atol, rtol=1e-2, name="y")
    assert torch.equal(final, final_ref), "the final conv state is a copy of inputs, bit for bit"


@pytest.mark.usefixtures("_interpreter")
@pytest.mark.parametrize("dtype, atol", CONV_TOL)
def test_triton_conv_update_matches_reference_and_skips_negative_slots(dtype, atol):
    from kvtier import ops

    dim = 20
    x, weight, bias, _ = conv_inputs(4, dim, 4, 1, dtype, seed=8)
    slots = torch.randn(6, dim, 3, generator=torch.Generator().manual_seed(9)).to(dtype)
    want = slots.clone()
    idx = _i32([2, -1, 5, 0])
    y = ops.causal_conv1d_update(x, weight, bias, slots, idx, backend="triton")
    y_ref = ref.causal_conv1d_update(x, weight, bias, want, idx)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert_close(y, y_ref, atol=atol, rtol=1e-2, name="y")
    assert torch.equal(slots, want)


def test_auto_on_cpu_runs_the_reference_through_the_registered_ops():
    from kvtier import ops
    from kvtier.ops.dispatch import resolve_backend

    assert all(resolve_backend(op, "auto", "cpu", torch.bfloat16) == "torch" for op in
               ("kda_chunk_prefill", "kda_recurrent_decode", "causal_conv1d_prefill", "causal_conv1d_update"))
    (q, k, v, g, beta), s0 = _kda_case([3, 6], torch.float32, seed=6)
    got = ops.kda_chunk_prefill(q, k, v, g, beta, s0, _cu([3, 6]), chunk_size=4)
    want = ref.kda_chunk_prefill(q, k, v, g, beta, s0, _cu([3, 6]), chunk_size=4)
    for name, a, e in zip(("o", "final_state", "checkpoint_states"), got, want):
        assert torch.equal(a, e), name


def test_opcheck_kda_ops():
    (q, k, v, g, beta), s0 = _kda_case([3, 0, 5], torch.float32, seed=12, H=2, K=8, V=4)
    cu = _cu([3, 0, 5])
    torch.library.opcheck(torch.ops.kvtier.kda_chunk_prefill.default,
                          (q, k, v, g, beta, s0, cu, 0.3, 4, True, _i32([2, 0]), _i32([4, 3])),
                          test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.kvtier.kda_chunk_prefill.default,
                          (q, k, v, g, beta, None, cu, 0.3, 4, False, None, None), test_utils=OPCHECK_UTILS)
    slots = random_state(4, 2, 8, 4)
    torch.library.opcheck(torch.ops.kvtier.kda_recurrent_decode.default,
                          (q[:3], k[:3], v[:3], g[:3], beta[:3], slots, _i32([3, -1, 0]), 0.3, True),
                          test_utils=OPCHECK_UTILS)
    x, weight, bias, state = conv_inputs(8, 6, 4, 3, seed=2)
    torch.library.opcheck(torch.ops.kvtier.causal_conv1d_prefill.default, (x, weight, bias, state, cu, True),
                          test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.kvtier.causal_conv1d_prefill.default, (x, weight, None, None, cu, False),
                          test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.kvtier.causal_conv1d_update.default,
                          (x[:2], weight, bias, state.clone(), _i32([1, -1]), True), test_utils=OPCHECK_UTILS)


def _bad_prefill(**override):
    from kvtier import ops

    (q, k, v, g, beta), s0 = _kda_case([3, 2], torch.float32, seed=0, H=2, K=8, V=4)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, cu_seqlens=_cu([3, 2]))
    kwargs = {key: override.pop(key) for key in list(override) if key not in args}
    args.update(override)
    return ops.kda_chunk_prefill(*args.values(), **kwargs)


@pytest.mark.parametrize("override, error, match", [
    (dict(k=torch.zeros(5, 2, 7)), ValueError, r"k must have shape \(5, 2, 8\), got \(5, 2, 7\)"),
    (dict(k=torch.zeros(5, 2, 8, dtype=torch.bfloat16)), ValueError, r"k must have dtype in \['torch.float32'\]"),
    (dict(beta=torch.zeros(5, 3)), ValueError, r"beta must have shape \(5, 2\)"),
    (dict(initial_state=torch.zeros(2, 2, 8, 5)), ValueError, r"initial_state must have shape \(2, 2, 8, 4\)"),
    (dict(cu_seqlens=torch.tensor([0, 3, 5])), ValueError, r"cu_seqlens must have dtype in \['torch.int32'\]"),
    (dict(cu_seqlens=_i32([0, 4, 3])), ValueError, r"cu_seqlens must start at 0, never decrease and end at"),
    (dict(cu_seqlens=_i32([0, 3, 4])), ValueError, r"end at num_tokens=5, got \[0, 3, 4\]"),
    (dict(checkpoint_seq=_i32([0])), ValueError, "checkpoint_seq and checkpoint_len must be given together"),
    (dict(checkpoint_seq=_i32([1]), checkpoint_len=_i32([3])), ValueError, r"checkpoint_len\[0\] must be in \[0, 2\]"),
    (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1, got 0"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
])
def test_prefill_bad_input_names_the_argument(override, error, match):
    with pytest.raises(error, match=match):
        _bad_prefill(**override)


def test_decode_and_conv_bad_input_names_the_argument():
    from kvtier import ops
    from kvtier.ops.dispatch import BackendUnavailableError

    (q, k, v, g, beta), _ = _kda_case([3], torch.float32, seed=0, H=2, K=8, V=4)
    slots = torch.zeros(4, 2, 8, 4)
    with pytest.raises(ValueError, match=r"state_indices must be < num_slots=4"):
        ops.kda_recurrent_decode(q, k, v, g, beta, slots, _i32([0, 4, -1]))
    with pytest.raises(ValueError, match="state_indices must be distinct where >= 0"):
        ops.kda_recurrent_decode(q, k, v, g, beta, slots, _i32([1, -1, 1]))
    with pytest.raises(ValueError, match="recurrent_state must be contiguous"):
        ops.kda_recurrent_decode(q, k, v, g, beta, torch.zeros(4, 2, 4, 8).transpose(2, 3), _i32([0, 1, 2]))
    big = [torch.zeros(1, 1, 512)] * 2
    with pytest.raises(BackendUnavailableError, match="head_k_dim <= 256, got 512"):
        ops.kda_recurrent_decode(*big, torch.zeros(1, 1, 4), big[0], torch.zeros(1, 1), torch.zeros(1, 1, 512, 4),
                                 _i32([0]), backend="triton")
    x, weight, bias, state = conv_inputs(4, 6, 4, 2, seed=1)
    with pytest.raises(ValueError, match=r"weight must have shape \(6, kernel_size >= 1\), got \(5, 4\)"):
        ops.causal_conv1d_prefill(x, weight[:5], bias, state, _cu([1, 3]))
    with pytest.raises(ValueError, match=r"conv_state must have shape \(2, 6, 3\)"):
        ops.causal_conv1d_prefill(x, weight, bias, state[..., :2], _cu([1, 3]))
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.causal_conv1d_update(x[:2], weight, bias, state, _i32([0, 1]), activation="relu")
    with pytest.raises(ValueError, match="state_indices must be distinct"):
        ops.causal_conv1d_update(x[:2], weight, bias, state, _i32([1, 1]))


KDA_KERNELS = ["kda_prefill", "kda_prefill_chunked", "kda_decode", "causal_conv1d_prefill", "causal_conv1d_final_state",
               "causal_conv1d_update"]


@pytest.mark.slow
def test_compile_gate_builds_the_kda_kernels_at_k3_shapes_without_spills(tmp_path):
    """perf/compile_gate.py at K3 shapes (96 heads x 128, conv dim 36,864) for gfx950, gfx942 and
    sm_90, in a subprocess (it needs compiled, not interpreted, kernels); about 10 s on two cores."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "perf" / "compile_gate.py"), "--out-dir", str(tmp_path),
                           "--kernels", *KDA_KERNELS], capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "kernel_resources.csv")))
    assert {(r["kernel"], r["target"]) for r in rows} == {(k, t) for k in KDA_KERNELS
                                                          for t in ("gfx950", "gfx942", "sm_90")}
    for r in rows:
        assert not r["error"] and r["spill_bytes"] == "0" and int(r["vgprs"]) > 0, r
        assert r["target"] == "sm_90" or int(r["vgpr_spills"]) == 0, r


# ---- compiled kernels on a GPU (pytest -m gpu; perf/gpu_check.sh runs them) ----------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def _on_gpu(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_heads", [8, 96])
@pytest.mark.parametrize("gate", ["random", "lower_bound"])
@pytest.mark.parametrize("chunk_size, s_tol", [(1, 1e-4), (64, 3e-2)], ids=["token-walk", "chunked"])
def test_gpu_kda_prefill_and_decode_at_k3_head_dim(num_heads, gate, chunk_size, s_tol):
    """Head dim 128 (K3's), bf16 q/k/v/beta, fp32 g and states, a mixed-length batch with interior
    checkpoints, then decode steps on the final states in shuffled slots. The chunked kernel's
    matrix products take bf16 operands on a GPU: its states get bf16-level tolerances and a cosine
    bound; the token-walking kernel computes in fp32 throughout."""
    from kvtier import ops

    lengths = [1, 0, 130, 64]
    (q, k, v, g, beta), s0 = _kda_case(lengths, torch.bfloat16, seed=num_heads, gate=gate, H=num_heads, K=128,
                                       V=128)
    q, k, v, g, beta, s0 = _on_gpu(q, k, v, g, beta, s0)
    cu = _cu(lengths).cuda()
    ck = dict(checkpoint_seq=_i32([2, 2, 3, 0]).cuda(), checkpoint_len=_i32([65, 130, 0, 1]).cuda())
    o, s, c = ops.kda_chunk_prefill(q, k, v, g, beta, s0, cu, chunk_size=chunk_size, backend="triton", **ck)
    o_ref, s_ref, c_ref = ops.kda_chunk_prefill(q, k, v, g, beta, s0, cu, backend="torch", **ck)
    assert_close(o, o_ref, atol=3e-2, rtol=3e-2, name="o", max_cos_diff=1e-4)
    assert_close(s, s_ref, atol=s_tol, rtol=s_tol, name="final_state", max_cos_diff=1e-4)
    assert_close(c, c_ref, atol=s_tol, rtol=s_tol, name="checkpoint_states", max_cos_diff=1e-4)
    slots = torch.full((6, num_heads, 128, 128), float("nan"), device="cuda")
    idx = _i32([5, 2, -1, 0]).cuda()
    slots[idx[idx >= 0].long()] = s[[0, 1, 3]]
    want = slots.clone()
    step = _kda_case([4], torch.bfloat16, seed=1, gate=gate, H=num_heads, K=128, V=128)[0]
    step = _on_gpu(*step)
    o = ops.kda_recurrent_decode(*step, slots, idx, backend="triton")
    o_ref = ops.kda_recurrent_decode(*step, want, idx, backend="torch")
    assert_close(o, o_ref, atol=2e-2, rtol=2e-2, name="decode o")
    assert_close(slots, want, atol=1e-4, rtol=1e-4, name="slots")


@pytest.mark.gpu
@needs_gpu
def test_gpu_conv_at_k3_width():
    from kvtier import ops

    dim, lengths = 3 * 96 * 128, [1, 0, 70, 3]
    x, weight, bias, state = _on_gpu(*conv_inputs(sum(lengths), dim, 4, len(lengths), torch.bfloat16, seed=1))
    cu = _cu(lengths).cuda()
    y, final = ops.causal_conv1d_prefill(x, weight, None, state, cu, backend="triton")
    y_ref, final_ref = ops.causal_conv1d_prefill(x, weight, None, state, cu, backend="torch")
    assert_close(y, y_ref, atol=1.6e-2, rtol=1e-2, name="conv y")
    assert torch.equal(final, final_ref)
    slots = torch.randn(5, dim, 3, device="cuda").to(torch.bfloat16)
    want = slots.clone()
    idx = _i32([4, -1, 1]).cuda()
    y = ops.causal_conv1d_update(x[:3], weight, bias, slots, idx, backend="triton")
    y_ref = ops.causal_conv1d_update(x[:3], weight, bias, want, idx, backend="torch")
    assert_close(y, y_ref, atol=1.6e-2, rtol=1e-2, name="conv update y")
    assert torch.equal(slots, want)


def test_bench_kda_dry_run_writes_rows_and_summary(tmp_path):
    """perf/bench_kda.py --dry-run (tiny CPU shapes, torch backend): every op has a row with a time,
    and the summary gives tokens/s; perf/gpu_check.sh runs it with these options."""
    import csv
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "perf/bench_kda.py", "--dry-run", "--budget-s", "60", "--repeats", "1",
                           "--csv", str(tmp_path / "kda.csv"), "--summary", str(tmp_path / "kda.md")],
                          capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "kda.csv")))
    assert {r["op"] for r in rows} == {"kda_chunk_prefill", "kda_recurrent_decode", "causal_conv1d_prefill",
                                       "causal_conv1d_update"}
    assert all(float(r["median_us"]) > 0 and r["resolved_backend"] == "torch" for r in rows)
    summary = (tmp_path / "kda.md").read_text()
    assert "| kda_chunk_prefill | B3xT16-H2-K16-C64 | torch |" in summary and "tokens/s" in summary
    bad = subprocess.run([sys.executable, "perf/bench_kda.py", "--dry-run", "--summary", "x.md"],
                         capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert bad.returncode == 2 and "--summary needs --csv PATH" in bad.stderr
