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
from kvtier.model.state_slots import StateBatch, StateSlots
from tests.helpers.kimi_linear_pair import ATOL, CONFIG, pair  # noqa: F401 - pair is a fixture
from tests.hf_reference import hf_token_logprobs

PAGE_SIZE = 16
PROMPT_LEN = 150


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
        hidden, ckpt = self.model.step(torch.tensor(ids), pos, batch, self.caches, self.state, sb)
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
