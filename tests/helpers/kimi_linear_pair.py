"""A random tiny kimi_linear model in transformers and in kvtier on the same fp32 weights (the parity reference)."""

from __future__ import annotations

import pytest
import torch

from kvtier.model.kimi_linear_config import KimiLinearConfig
from kvtier.model.kimi_linear_loader import load_hybrid_model

transformers = pytest.importorskip("transformers", reason="transformers (a test extra) is the parity reference")
if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip("transformers >= 5.25 ships KimiLinearForCausalLM", allow_module_level=True)

ATOL = 1e-4
CONFIG = KimiLinearConfig(
    hidden_size=64, num_hidden_layers=4, kda_layers=(1, 2, 3), full_attn_layers=(4,), linear_num_heads=4,
    linear_head_dim=16, short_conv_kernel_size=4, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1,
    routed_scaling_factor=2.446, vocab_size=1000, rms_norm_eps=1e-5, eos_token_id=(),
)


def hf_config(c: KimiLinearConfig):
    return transformers.KimiLinearConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads,
        n_shared_experts=c.n_shared_experts, num_local_experts=c.n_routed_experts,
        num_experts_per_tok=c.num_experts_per_tok, routed_scaling_factor=c.routed_scaling_factor,
        kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim, qk_nope_head_dim=c.qk_nope_head_dim, n_group=c.n_group, topk_group=c.topk_group,
        rms_norm_eps=c.rms_norm_eps, first_k_dense_replace=c.first_k_dense_replace,
        linear_attn_config={"kda_layers": list(c.kda_layers), "full_attn_layers": list(c.full_attn_layers),
                            "num_heads": c.linear_num_heads, "head_dim": c.linear_head_dim,
                            "short_conv_kernel_size": c.short_conv_kernel_size},
        pad_token_id=None, bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, kvtier model) on the same random fp32 weights."""
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(hf_config(CONFIG)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_((1.0 + 15.0 * torch.rand(p.shape, generator=gen)).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) - 3.0)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    path = tmp_path_factory.mktemp("kimi_linear")
    hf.save_pretrained(str(path))
    ours = load_hybrid_model(path, torch.float32, backend="torch")
    assert ours.config == CONFIG
    return hf, ours
