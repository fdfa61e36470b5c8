"""Presence and frequency penalties: the arithmetic against a per-token count written out
by hand, the range checks of SamplingParams, and the engine sampling from the penalised logits
(the logprobs it returns stay the model's)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvtier.serve.params import SamplingParams
from kvtier.serve.penalties import apply_penalties


def _by_hand(row: list[float], ids: list[int], presence: float, frequency: float) -> list[float]:
    counts = Counter(ids)
    return [v - (presence if counts[t] else 0.0) - frequency * counts[t] for t, v in enumerate(row)]


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 1.25), (-2.0, 2.0), (1.0, -0.5)])
def test_penalties_match_the_definition_row_by_row(presence, frequency):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 37, generator=g)
    before = logits.clone()
    history = [[5, 5, 5, 36, 0], [], [7]]  # a repeated token, none yet, one
    rows = [(history[0], presence, frequency), (history[1], presence, frequency), (history[2], 0.0, 0.0)]
    out = apply_penalties(logits, rows)
    assert torch.equal(logits, before)  # not modified: logprobs are read from it
    for i, (ids, p, f) in enumerate(rows):
        torch.testing.assert_close(out[i], torch.tensor(_by_hand(before[i].tolist(), ids, p, f)))


def test_no_penalty_returns_the_same_tensor_and_bad_rows_are_refused():
    logits = torch.zeros(2, 8)
    assert apply_penalties(logits, [([1, 2], 0.0, 0.0), ([], 1.0, 1.0)]) is logits
    with pytest.raises(ValueError, match="one entry per row"):
        apply_penalties(logits, [([1], 1.0, 0.0)])


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.0001, -2.5, math.nan, math.inf, "1", True])
def test_sampling_params_refuse_penalties_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_engine_samples_from_penalised_logits(monkeypatch):
    """Each step's ``ops.sample`` gets the model's logits minus the penalty of the tokens the
    request generated before that step; greedy picks their argmax."""
    from kvtier import LLM
    from kvtier.serve import sampler as sampler_mod

    llm = LLM("tiny", num_device_pages=64)
    seen = []  # (raw logits row, generated ids before the step, logits given to the sampler)
    real_sample, real_rows = sampler_mod.ops.sample, sampler_mod.Sampler._sample_rows

    def rows_spy(self, live, logits):
        seen.append([logits[0].clone(), list(live[0][0].output_token_ids)])
        return real_rows(self, live, logits)

    def sample_spy(logits, *a, **kw):
        seen[-1].append(logits[0].clone())
        return real_sample(logits, *a, **kw)

    monkeypatch.setattr(sampler_mod.Sampler, "_sample_rows", rows_spy)
    monkeypatch.setattr(sampler_mod.ops, "sample", sample_spy)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=-0.75, logprobs=True)
    out = llm.generate(prompt_token_ids=[[11, 12, 13, 14]], sampling_params=params)[0]
    assert len(seen) == 12 and out.token_ids == [int(s[2].argmax()) for s in seen]
    for raw, before, given in seen:
        want = torch.tensor(_by_hand(raw.tolist(), before, 1.5, -0.75))
        torch.testing.assert_close(given, want)
    # logprobs: of the chosen token under the model's own distribution
    for lp, (raw, _, _), t in zip(out.logprobs, seen, out.token_ids):
        assert lp == pytest.approx(float(torch.log_softmax(raw, -1)[t]), abs=1e-5)
