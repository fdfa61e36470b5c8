"""Prompt log-prob parity with transformers' KimiLinearForCausalLM (pure-torch KDA on CPU), fp32.

A random tiny ``kimi_linear`` model with 3 KDA layers and 1 MLA layer is saved by transformers in
the released checkpoint layout and loaded by kvtier. kvtier runs the prompt on a NaN-filled page
pool with shuffled pages and a state-slot pool whose other slots are NaN: whole, in 3 chunks
that carry the KDA state and MLA pages, ending in single-token decode steps, and resumed from a
state handed back at a chosen token.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.model import AttentionBatch
from kvtier.model.kimi_linear_config import KimiLinearConfig
from kvtier.model.kimi_linear_loader import load_hybrid_model
from kvtier.model.state_slots import StateBatch, StateSlots
from tests.hf_reference import hf_token_logprobs

transformers = pytest.importorskip("transformers", reason="transformers (a test extra) is the parity reference")
if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip("transformers >= 5.25 ships KimiLinearForCausalLM", allow_module_level=True)

ATOL = 1e-4
PAGE_SIZE = 16
CONFIG = KimiLinearConfig(
    hidden_size=64, num_hidden_layers=4, kda_layers=(1, 2, 3), full_attn_layers=(4,), linear_num_heads=4,
    linear_head_dim=16, short_conv_kernel_size=4, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1,
    routed_scaling_factor=2.446, vocab_size=1000, rms_norm_eps=1e-5, eos_token_id=(),
)
PROMPT_LEN = 150


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


class Session:
    """One sequence on a poisoned paged cache and state pool, fed step by step."""

    def __init__(self, model, length: int, seed: int = 0):
        c = model.config
        self.model = model
        num_pages = -(-length // PAGE_SIZE)
        pages = list(range(num_pages + 3))
        random.Random(seed).shuffle(pages)
        self.block_table = torch.tensor([pages[:num_pages]], dtype=torch.int32)
        self.caches = [torch.full((num_pages + 3, PAGE_SIZE, c.kv_cache_dim), float("nan"))
                       for _ in c.full_attn_layers]
        self.state = StateSlots(c, 3)
        for t in (*self.state.recurrent, *self.state.conv):
            t.fill_(float("nan"))
        self.state.allocate()
        self.slot = self.state.allocate()

    def _slots(self, pos):
        return (self.block_table[0, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE)

    def extend(self, ids, start, checkpoints=()):
        n = len(ids)
        pos = torch.arange(start, start + n)
        batch = AttentionBatch(slot_mapping=self._slots(pos), num_prefill_tokens=n,
                               prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                               prefill_seq_lens=torch.tensor([start + n], dtype=torch.int32),
                               prefill_block_table=self.block_table)
        sb = StateBatch(prefill_slots=torch.tensor([self.slot], dtype=torch.int32))
        if checkpoints:
            sb.checkpoint_seq = torch.zeros(len(checkpoints), dtype=torch.int32)
            sb.checkpoint_len = torch.tensor(checkpoints, dtype=torch.int32)
        hidden, ckpt = self.model.forward_with_checkpoints(torch.tensor(ids), pos, batch, self.caches, self.state, sb)
        return self.model.compute_logits(hidden), ckpt

    def decode(self, token, pos):
        p = torch.tensor([pos])
        batch = AttentionBatch(slot_mapping=self._slots(p), num_prefill_tokens=0,
                               decode_seq_lens=torch.tensor([pos + 1], dtype=torch.int32),
                               decode_block_table=self.block_table)
        sb = StateBatch(decode_slots=torch.tensor([self.slot], dtype=torch.int32))
        return self.model.compute_logits(self.model(torch.tensor([token]), p, batch, self.caches, self.state, sb))


def token_logprobs(logits, ids):
    lp = torch.log_softmax(logits.double(), -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def assert_close(ours, theirs, what):
    err = (ours.double() - theirs.double()).abs()
    print(f"{what}: max |diff| {float(err.max()):.3g}")
    assert float(err.max()) <= ATOL, f"{what}: max |diff| {float(err.max()):.3g} at {int(err.argmax())}"


def prompt(seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (PROMPT_LEN,), generator=g).tolist()


@pytest.mark.parametrize("chunks", [(PROMPT_LEN,), (50, 37, 63)], ids=["whole", "3chunks"])
def test_prompt_logprobs_match_transformers(pair, chunks):
    hf, ours = pair
    ids = prompt()
    ref = hf_token_logprobs(hf, ids)
    session, start, logits = Session(ours, PROMPT_LEN), 0, []
    for n in chunks:
        logits.append(session.extend(ids[start:start + n], start)[0])
        start += n
    assert_close(token_logprobs(torch.cat(logits), ids), ref, f"prompt logprobs, chunks {chunks}")


def test_decode_steps_match_transformers(pair):
    """Prefill then 4 single-token steps (conv update, recurrent KDA, paged MLA decode)."""
    hf, ours = pair
    ids = prompt(8)
    ref = hf_token_logprobs(hf, ids)
    session = Session(ours, PROMPT_LEN, seed=1)
    logits = [session.extend(ids[:-4], 0)[0]]
    logits += [session.decode(ids[p], p) for p in range(PROMPT_LEN - 4, PROMPT_LEN)]
    assert_close(token_logprobs(torch.cat(logits), ids), ref, "prefill + decode logprobs")


def test_resume_from_state_handed_back_mid_chunk(pair):
    """The state at token 87 (inside a 150-token chunk) restored into a fresh slot continues the
    sequence as transformers does."""
    hf, ours = pair
    ids = prompt(9)
    ref = hf_token_logprobs(hf, ids)
    session = Session(ours, PROMPT_LEN, seed=2)
    _, ckpt = session.extend(ids, 0, checkpoints=(87, 0))
    assert ckpt.recurrent.shape[:2] == (3, 2) and ckpt.conv.shape[:2] == (3, 2)
    assert torch.count_nonzero(ckpt.recurrent[:, 1]) == 0  # length 0: the zero state the sequence started from
    session.state.free(session.slot)
    session.slot = session.state.allocate()
    session.state.load(session.slot, ckpt, 0)
    logits, _ = session.extend(ids[87:], 87)
    assert_close(token_logprobs(logits, ids[87:]), ref[87:], "logprobs resumed at token 87")
