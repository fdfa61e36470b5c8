"""Hugging Face transformers DeepseekV3ForCausalLM as the independent implementation.

Builds a transformers model from a :class:`KimiK2Config`, randomises the parameters that
transformers initialises to constants (norm weights, routing bias) so that every path matters,
and saves it with ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.model import KimiK2Config

transformers = pytest.importorskip("transformers", reason="transformers (a test extra) is the parity reference")


def hf_config(c: KimiK2Config):
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rs = c.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": c.rope_theta, "factor": rs.factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale,
                "mscale_all_dim": rs.mscale_all_dim}
    return transformers.DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads,
        n_shared_experts=c.n_shared_experts, n_routed_experts=c.n_routed_experts,
        routed_scaling_factor=c.routed_scaling_factor, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, qk_nope_head_dim=c.qk_nope_head_dim,
        n_group=c.n_group, topk_group=c.topk_group, num_experts_per_tok=c.num_experts_per_tok,
        first_k_dense_replace=c.first_k_dense_replace, norm_topk_prob=c.norm_topk_prob,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=rope, rope_interleave=True, tie_word_embeddings=False, num_mtp_layers=0,
        attn_implementation="eager",
    )


def make_hf_checkpoint(c: KimiK2Config, path: Path, seed: int):
    """Random fp32 DeepseekV3ForCausalLM saved to ``path``; returns the model (eval mode)."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config(c)).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(str(path))
    return model


@torch.no_grad()
def hf_token_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1] fp32: log p(token[i+1] | tokens[:i+1]) under the transformers model."""
    logits = model(torch.tensor([token_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[:-1].gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)


@torch.no_grad()
def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] fp32 log-probabilities of the next token at every position."""
    return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), -1)
