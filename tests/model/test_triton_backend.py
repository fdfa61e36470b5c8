"""The tiny model with its paged attention and routed experts on the Triton kernels (interpreter
on CPU) matches the torch backend's log-probabilities: prompt log-probs over a chunked prefill
(mla_extend on a cached prefix, moe_route + fused_moe per chunk) and the generated tokens'
log-probs (mla_decode, greedy sampling with a presence penalty on the triton kernel too), on a NaN-poisoned, shuffled page
pool."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvtier import LLM, SamplingParams  # noqa: E402
from kvtier.ops import attention, dispatch, moe, sampling  # noqa: E402
from tests.helpers.poisoned_engines import poisoned_llm  # noqa: E402

ATOL = 1e-4  # fp32 both ways: the kernels accumulate in fp32 in another order than the reference
OPS = {"mla_extend", "mla_decode", "moe_route", "fused_moe", "sample"}


def _run(backend, monkeypatch):
    """Generate 3 greedy tokens (a presence penalty) of a 13-token prompt; returns (output, {op: resolved backends})."""
    resolved: dict[str, set[str]] = {}

    def recording(op, *args):
        name = dispatch.resolve_backend(op, *args)
        resolved.setdefault(op, set()).add(name)
        return name

    for module in (attention, moe, sampling):  # attention: the plans resolve mla_decode and mla_extend
        monkeypatch.setattr(module, "resolve_backend", recording)
    llm = poisoned_llm("tiny", seed=3, max_num_batched_tokens=8)  # chunks of 8: later chunks attend to a prefix
    llm.engine.runner.model.set_backend(backend)
    prompt = torch.randint(0, llm.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    # a presence penalty keeps the greedy rows on ops.sample (an all-greedy step without penalties
    # takes each row's argmax and makes no sampling call)
    params = SamplingParams(max_tokens=3, temperature=0.0, presence_penalty=0.5, logprobs=True, prompt_logprobs=True)
    return llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0], resolved


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; GPUs run the compiled kernels")
def test_tiny_model_triton_backend_matches_torch(monkeypatch):
    assert dispatch.is_backend_supported("mla_decode", "triton", "cpu"), "needs TRITON_INTERPRET=1 (tests/conftest.py)"
    ref, ref_backends = _run("torch", monkeypatch)
    got, got_backends = _run("triton", monkeypatch)
    assert {op: ref_backends.get(op) for op in OPS} == {op: {"torch"} for op in OPS}
    assert {op: got_backends.get(op) for op in OPS} == {op: {"triton"} for op in OPS}
    assert got.token_ids == ref.token_ids
    assert torch.allclose(torch.tensor(got.prompt_logprobs), torch.tensor(ref.prompt_logprobs), atol=ATOL)
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=ATOL)
