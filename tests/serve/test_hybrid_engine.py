"""The engine over a hybrid KDA + MLA model (``tiny-k3``): what it generates equals the model run
directly on the whole sequence from a fresh state, whether the prompt runs in one step or in
chunks, alone or batched with others, and after a preemption; state slots are taken and given back
(kvtier/serve/hybrid_state.py)."""

from __future__ import annotations

import pytest
import torch

from kvtier import SamplingParams
from kvtier.model.batch import AttentionBatch
from kvtier.model.state_slots import StateBatch, StateSlots
from kvtier.serve import Engine, EngineConfig
from kvtier.serve.hybrid_state import device_only
from tests.helpers.hybrid_engine import PARAMS, llm, prompt, run  # noqa: F401 - llm is a fixture

TOL = 1e-4  # fp32 engine vs direct forward, log-probabilities


@torch.inference_mode()
def direct_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32 log-softmax of the model run on ``tokens`` in one prefill from a
    zeroed state (its own page pool and one state slot)."""
    c, n, ps = model.config, len(tokens), 16
    pages = -(-n // ps)
    caches = [torch.zeros(pages, ps, c.kv_cache_dim) for _ in c.full_attn_layers]
    attn = AttentionBatch(slot_mapping=torch.arange(n, dtype=torch.int64), num_prefill_tokens=n,
                          prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                          prefill_seq_lens=torch.tensor([n], dtype=torch.int32),
                          prefill_block_table=torch.arange(pages, dtype=torch.int32)[None])
    hidden = model(torch.tensor(tokens), torch.arange(n), attn, caches, StateSlots(c, 1),
                   StateBatch(prefill_slots=torch.tensor([0], dtype=torch.int32)))
    return torch.log_softmax(model.compute_logits(hidden), dim=-1)


def check_against_direct(model, prompt_ids: list[int], out) -> None:
    """``out`` (greedy, logprobs and prompt logprobs) equals the direct forward over prompt + output."""
    lp = direct_logprobs(model, prompt_ids + out.token_ids[:-1])
    n = len(prompt_ids)
    want_prompt = [lp[p, prompt_ids[p + 1]].item() for p in range(n - 1)]
    assert out.prompt_logprobs == pytest.approx(want_prompt, abs=TOL)
    rows = lp[n - 1:]
    assert out.token_ids == rows.argmax(-1).tolist()
    assert out.logprobs == pytest.approx([rows[i, t].item() for i, t in enumerate(out.token_ids)], abs=TOL)


def engine_over(llm, **args) -> Engine:
    return Engine(llm.engine.runner.model, EngineConfig.of(**{"page_size": 16, **args}), b"tiny-k3")


def test_llm_tiny_k3_generates_what_the_model_computes_directly(llm):
    p = prompt(37, 1)
    out = llm.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0]
    assert out.error is None and len(out.token_ids) == 4 and out.num_cached_tokens == 0
    check_against_direct(llm.engine.runner.model, p, out)
    assert "states" in llm.engine.pool.layouts()  # hybrid: blocks reused only with the state checkpoint at their end


@pytest.mark.parametrize("max_num_batched_tokens", [7, 16, 256])
def test_chunked_and_batched_prompts_carry_their_state(llm, max_num_batched_tokens):
    """Three prompts of different lengths: in chunks of 7 or 16 tokens (the state crosses each
    chunk boundary, chunks and decodes share steps) or all at once (one batched prefill)."""
    engine = engine_over(llm, num_device_pages=64, max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens)
    prompts = [prompt(37, 2), prompt(11, 3), prompt(23, 4)]
    outs = run(engine, prompts)
    for p, out in zip(prompts, outs, strict=True):
        check_against_direct(engine.runner.model, p, out)
    hybrid = engine.runner.recurrent_state
    hybrid.release_stale()
    assert hybrid.slots.num_free == 4  # every slot back


def test_preempted_hybrid_sequences_recompute_and_give_the_same_tokens(llm):
    prompts = [prompt(20, 5), prompt(18, 6), prompt(16, 7)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    roomy = run(engine_over(llm, num_device_pages=64, max_num_seqs=4), prompts, params)
    tight = engine_over(llm, page_size=4, num_device_pages=12, max_num_seqs=4)
    got = run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in roomy]
    tight.runner.recurrent_state.release_stale()
    assert tight.runner.recurrent_state.slots.num_free == 4


def test_slots_follow_admission_finish_and_abort(llm):
    engine = engine_over(llm, num_device_pages=64, max_num_seqs=3, max_num_batched_tokens=64)
    hybrid = engine.runner.recurrent_state
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    a, b = engine.add_request(prompt(9, 8), params), engine.add_request(prompt(5, 9), params)
    engine.step()
    seq_a, seq_b = engine.sequence(a), engine.sequence(b)
    assert {hybrid.slot_of(seq_a), hybrid.slot_of(seq_b)} <= set(range(3)) and hybrid.slots.num_free == 1
    engine.abort([a])
    c = engine.add_request(prompt(6, 10), params)
    engine.step()  # a's slot is freed before c takes one
    assert hybrid.slot_of(seq_a) is None and hybrid.slot_of(engine.sequence(c)) is not None
    while engine.has_unfinished():
        engine.step()
    hybrid.release_stale()
    assert hybrid.slots.num_free == 3


def test_hybrid_engine_without_prefix_caching_drops_its_tiers_and_says_so(llm, caplog):
    cfg = EngineConfig.of(page_size=16, num_device_pages=8, host_cache_bytes=1 << 20, enable_prefix_caching=False)
    with caplog.at_level("WARNING", logger="kvtier.serve.hybrid_state"):
        off = device_only(cfg)
    assert "prefix caching off" in caplog.text and "host_cache_bytes" in caplog.text
    assert not off.pool.enable_prefix_caching and off.pool.host_cache_bytes == 0
    assert device_only(off) is off
    on = EngineConfig.of(page_size=16, num_device_pages=8, host_cache_bytes=1 << 20)
    assert device_only(on) is on  # prefix caching on: the pool keeps state checkpoints instead
    with pytest.raises(ValueError, match="cuda_graph=True is not supported for hybrid"):
        Engine(llm.engine.runner.model, EngineConfig.of(page_size=16, num_device_pages=8, cuda_graph=True))


def test_turn_end_crosses_as_data_and_is_the_state_at_its_boundary(llm):
    """A decode that crosses a page boundary leaves its turn end in the step result (a host row,
    no device copy); the engine saves it when the request finishes, and it holds exactly the state
    of a direct forward over the tokens before that boundary."""
    engine = engine_over(llm, num_device_pages=64, max_num_seqs=2)
    results = []
    run_step = engine.runner.run
    engine.runner.run = lambda batch: results.append(run_step(batch)) or results[-1]
    p = prompt(10, 12)
    out = run(engine, [p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    ends = [c for r in results for c in r.turn_ends.values()]
    assert ends and {c.num_tokens for c in ends} == {16} and all(c.payload.device.type == "cpu" for c in ends)
    stats = engine.pool.stats().sections["state"]
    assert stats.saved["turn"] == 1  # the prompt (10 tokens) ends before the first boundary: only the turn end
    model, tokens = engine.runner.model, (p + out.token_ids)[:16]
    c, n = model.config, 16
    caches = [torch.zeros(1, n, c.kv_cache_dim) for _ in c.full_attn_layers]
    attn = AttentionBatch(slot_mapping=torch.arange(n, dtype=torch.int64), num_prefill_tokens=n,
                          prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                          prefill_seq_lens=torch.tensor([n], dtype=torch.int32),
                          prefill_block_table=torch.zeros(1, 1, dtype=torch.int32))
    direct = StateSlots(c, 1)
    with torch.inference_mode():
        model(torch.tensor(tokens), torch.arange(n), attn, caches, direct,
              StateBatch(prefill_slots=torch.tensor([0], dtype=torch.int32)))
    torch.testing.assert_close(ends[-1].payload.view(torch.float32), direct.pack(0).view(torch.float32),
                               atol=TOL, rtol=0)
