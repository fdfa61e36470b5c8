"""A model-free stand-in for ``LLM("tiny")``: the real engine, scheduler and pool over the tiny
preset's page pools and limits, run by a runner that computes nothing.

Each step lasts a modelled time (so the cost model and the step-time model see the same
seconds on every machine and every run) and ends when the pool's background writes have ended
(a step of the tiny model is long enough for them; a runner that computes nothing is not, and
without the wait a block's copy to the host tier would race the next step). A sequence that
reaches its end gets a token that depends only on its own ids so far: its output is the same
whatever it is batched with, preempted or recomputed, as a real model's greedy output is. Scheduler tests run on it in
milliseconds a step instead of a forward pass of the tiny model.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from kvtier.model.config import preset
from kvtier.serve.config import EngineConfig
from kvtier.serve.engine import Engine
from kvtier.serve.runner import StepResult
from kvtier.serve.step_plan import ScheduledBatch

STEP_S = 2e-3
"""Modelled seconds of a step's fixed cost."""
TOKEN_S = 2e-5
"""Modelled seconds per token of a step (50K tokens/s)."""


def standin_token(seq, vocab_size: int) -> int:
    """The token a sequence gets next: a hash of its ids so far (never depends on the batch)."""
    ids = np.asarray(list(seq.prompt_token_ids) + list(seq.output_token_ids), dtype=np.uint32)
    return zlib.crc32(ids.tobytes()) % vocab_size


class StandInRunner:
    """A :class:`~kvtier.serve.runner.StepRunner` with the page pools a model of ``model_config``
    would have (one ``[num_device_pages, page_size, kv_cache_dim]`` fp32 pool per layer, so host
    and disk tiers count the same bytes per block) and no model."""

    def __init__(self, config: EngineConfig, model_config):
        self.model_config = model_config
        self.pool = None  # the engine's, set once it is built: each step waits for its writes
        self.device = torch.device("cpu")
        shape = (config.pool.num_device_pages, config.pool.page_size, model_config.kv_cache_dim)
        self.kv_caches = [torch.zeros(shape, dtype=torch.float32) for _ in range(model_config.num_hidden_layers)]

    def run(self, batch: ScheduledBatch) -> StepResult:
        ending = [s for s, n in batch.extends if s.num_computed_tokens + n == s.num_tokens] + list(batch.decodes)
        vocab = self.model_config.vocab_size
        if self.pool is not None:
            self.pool.poll(wait=True)
        return StepResult(tokens={s.seq_id: standin_token(s, vocab) for s in ending},
                          seconds=STEP_S + TOKEN_S * batch.num_tokens)


class StandInLLM:
    """``LLM(model, **engine_args)`` over a :class:`StandInRunner`: ``.engine`` and ``.generate``."""

    def __init__(self, model: str = "tiny", seed: int = 0, **engine_args):
        config = EngineConfig.of(seed=seed, **engine_args)
        runner = StandInRunner(config, preset(model))
        self.engine = Engine(None, config, runner=runner)
        runner.pool = self.engine.pool

    def generate(self, prompt_token_ids, sampling_params):
        """Each prompt's :class:`~kvtier.serve.params.RequestOutput`, in order (run to the end)."""
        rids = [self.engine.add_request(p, sampling_params, i) for i, p in enumerate(prompt_token_ids)]
        outs = {}
        while self.engine.has_unfinished():
            outs.update({o.request_id: o for o in self.engine.step()})
        return [outs[r] for r in rids]

