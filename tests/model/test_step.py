"""Every model class has the same step (:class:`kvtier.model.step.StepModel`), so a runner has one
path for K2 and the hybrid models; K2 takes no recurrent state and returns no checkpoints."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvtier.model import KimiK2ForCausalLM, preset
from kvtier.model.kimi_linear import KimiLinearForCausalLM
from kvtier.model.state_slots import StateBatch, StateSlots
from kvtier.model.step import StepModel
from kvtier.serve.hybrid_state import NoRecurrentState, recurrent_state
from kvtier.serve.config import EngineConfig
from tests.helpers.step_inputs import one_prefill

MODELS = (KimiK2ForCausalLM, KimiLinearForCausalLM)


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", ["plan", "step", "cache_spec", "compute_logits"])
def test_every_model_class_has_the_protocols_signature(name):
    want = _params(getattr(StepModel, name))
    assert [_params(getattr(cls, name)) for cls in MODELS] == [want, want]


def test_k2_step_is_its_forward_with_no_checkpoints_and_refuses_a_state():
    torch.manual_seed(0)
    model = KimiK2ForCausalLM(preset("tiny"))
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    ids, pos, batch, caches = one_prefill(model, 5)
    hidden, checkpoints = model.step(ids, pos, batch, caches)
    assert checkpoints is None
    torch.testing.assert_close(hidden, model(ids, pos, batch, [torch.zeros_like(c) for c in caches]))
    with pytest.raises(ValueError, match="state and state_batch must be None for an attention-only model"):
        model.step(ids, pos, batch, caches, StateSlots(preset("tiny-k3"), 1), StateBatch())
    assert isinstance(recurrent_state(model, EngineConfig()), NoRecurrentState)


def test_hybrid_step_needs_its_state_slots():
    model = KimiLinearForCausalLM(preset("tiny-k3"))
    ids, pos, batch, caches = one_prefill(model, 5)
    with pytest.raises(ValueError, match="state and state_batch are required for a hybrid model"):
        model.step(ids, pos, batch, caches)
    with pytest.raises(ValueError, match=r"cuda_graph=True is not supported for hybrid"):
        recurrent_state(model, EngineConfig(cuda_graph=True))
