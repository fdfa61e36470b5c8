"""The engine samples a whole step in one ``ops.sample`` call: greedy, temperature, top-p, grammar
masks and per-request seeds mixed in one batch, with the tokens the one-row-at-a-time path gave.

The runner here is a stand-in whose logits depend only on a sequence's first prompt token and its
length (so a request sees the same logits whatever it is batched with), over a 300-token
vocabulary, so the Triton kernel runs under the interpreter.
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from kvtier import EngineConfig, SamplingParams, ops
from kvtier.serve import sampler as sampler_module
from kvtier.serve.engine import Engine
from kvtier.serve.runner import SeqLogits, StepResult

VOCAB = 300
WORDS = (VOCAB + 31) // 32


def _logits(seq) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seq.prompt_token_ids[0] * 7919 + seq.num_tokens)
    return torch.randn(VOCAB, generator=gen) * 3


class LogitsRunner:
    """Logits for every sequence a step ends; ``backend`` is what the engine samples with."""

    def __init__(self, config: EngineConfig, backend: str):
        self.model_config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=4096, eos_token_id=())
        self.device = torch.device("cpu")
        self.kv_caches = [torch.zeros((config.pool.num_device_pages, config.pool.page_size, 1), dtype=torch.float32)]
        self.model = SimpleNamespace(backend=backend)

    def run(self, batch) -> StepResult:
        ending = [s for s, n in batch.extends if s.num_computed_tokens + n == s.num_tokens] + list(batch.decodes)
        return StepResult(logits={s.seq_id: SeqLogits(_logits(s), [], None) for s in ending})


def _allowed(first_token: int, step: int) -> list[int]:
    """The tokens a stand-in grammar allows: 40 of them, changing every step, never the argmax's
    neighbourhood only (so the mask matters to greedy rows too)."""
    gen = torch.Generator().manual_seed(first_token * 131 + step)
    return sorted(torch.randperm(VOCAB, generator=gen)[:40].tolist())


def _pack(allowed: list[int]) -> torch.Tensor:
    words = [0] * WORDS
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]], dtype=torch.int32)


class StandInConstraint:
    """Takes the sampled token as it is, after checking the mask held; never finishes."""

    finished = False

    def __init__(self, first_token: int):
        self.first_token, self.step = first_token, 0

    def take(self, token: int) -> int:
        assert token in _allowed(self.first_token, self.step), (self.first_token, self.step, token)
        self.step += 1
        return token


def _engine(backend: str, fail_mask_at: dict | None = None) -> Engine:
    config = EngineConfig.of(page_size=16, num_device_pages=64, max_num_batched_tokens=256, seed=11)
    engine = Engine(None, config, runner=LogitsRunner(config, backend))

    def start_masks(batch):  # what GrammarRuntime._fill_masks would give: one row per constrained sequence that samples
        ending = [s for s, n in batch.extends if s.num_computed_tokens + n == s.num_tokens] + list(batch.decodes)
        rows = {}
        for s in ending:
            if s.constraint is not None:
                step = s.constraint.step
                failing = (fail_mask_at or {}).get(s.prompt_token_ids[0]) == step
                rows[s.seq_id] = "GrammarError: stand-in failure" if failing else _pack(
                    _allowed(s.prompt_token_ids[0], step))
        done = Future()
        done.set_result(rows)
        return done if rows else None

    engine.grammar.start_masks = start_masks
    return engine


# (first prompt token, params, constrained): greedy, temperature, top-p, with and without a grammar
MIXED = [
    (101, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), False),
    (102, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True), True),
    (103, SamplingParams(max_tokens=5, temperature=0.7, seed=5, ignore_eos=True, logprobs=True), False),
    (104, SamplingParams(max_tokens=5, temperature=1.0, top_p=0.8, seed=6, ignore_eos=True), False),
    (105, SamplingParams(max_tokens=5, temperature=1.3, ignore_eos=True), False),
    (106, SamplingParams(max_tokens=5, temperature=1.0, top_p=0.5, ignore_eos=True), True),
    (107, SamplingParams(max_tokens=5, temperature=0.9, seed=7, ignore_eos=True), True),
    (108, SamplingParams(max_tokens=5, temperature=0.0, seed=8, ignore_eos=True, logprobs=True), False),
]


def _add(engine: Engine, cases) -> list[int]:
    rids = []
    for first, params, constrained in cases:
        rid = engine.add_request([first] + list(range(1, 20)), params)
        if constrained:
            engine.sequence(rid).constraint = StandInConstraint(first)
        rids.append(rid)
    return rids


def _run(engine: Engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return outs


def _per_sequence(sample, logits, temperature, top_p, token_bitmask, generators, backend) -> list[int]:
    """The engine's path before batching: one ``ops.sample`` per sequence on its row, its mask row
    and its generator (the request's own, else the engine's shared one, drawn in row order)."""
    tokens = []
    for i, gen in enumerate(generators):
        mask = None if token_bitmask is None or bool((token_bitmask[i] == -1).all()) else token_bitmask[i:i + 1]
        tokens.append(int(sample(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], token_bitmask=mask,
                                     generator=gen, backend=backend)[0]))
    return tokens


class SamplingSpy:
    """Counts the engine's ``ops.sample`` calls and, before each, replays the per-sequence path on
    copies of the generators (so the real call sees the states the per-sequence path would)."""

    def __init__(self, monkeypatch):
        self.calls, self.real = [], ops.sample
        monkeypatch.setattr(sampler_module.ops, "sample", self)

    def __call__(self, logits, temperature, top_p, token_bitmask=None, generator=None, *, backend="auto"):
        copies = {}
        for g in generator:
            copies.setdefault(id(g), torch.Generator().set_state(g.get_state()))
        before = _per_sequence(self.real, logits, temperature, top_p, token_bitmask, [copies[id(g)] for g in generator],
                               backend)
        got = self.real(logits, temperature, top_p, token_bitmask, generator, backend=backend)
        self.calls.append(dict(rows=logits.shape[0], got=got.tolist(), before=before,
                               greedy=(temperature <= 0).tolist(), logits=logits.clone()))
        return got


def test_one_sampling_call_per_step_gives_the_per_sequence_tokens_triton(monkeypatch):
    """Triton backend (as on a GPU): every row, greedy or seeded or drawn from the engine's
    generator, gets exactly the token the per-sequence path gave; logprobs as before."""
    spy = SamplingSpy(monkeypatch)
    engine = _engine("triton")
    rids = _add(engine, MIXED)
    outs = _run(engine)
    assert len(spy.calls) == engine.num_steps == 5  # one call per step, every step samples all 8
    assert all(c["rows"] == 8 for c in spy.calls)
    for c in spy.calls:
        assert c["got"] == c["before"]
    for i, rid in enumerate(rids):
        out = outs[rid]
        assert out.error is None and out.token_ids == [c["got"][i] for c in spy.calls]
        if MIXED[i][1].logprobs:
            want = [float(torch.log_softmax(c["logits"][i], -1)[c["got"][i]]) for c in spy.calls]
            assert out.logprobs == pytest.approx(want, abs=1e-6)
    # the grammar rows never left their masks (StandInConstraint.take asserts it) and the masks bit:
    # row 1 is greedy, so its token is the best allowed one, not the row's argmax
    assert any(c["got"][1] != int(c["logits"][1].argmax()) for c in spy.calls)


def test_one_sampling_call_per_step_torch_backend(monkeypatch):
    """Torch backend (CPU): greedy rows equal the per-sequence path exactly; sampled rows take the
    inverse CDF of one uniform from their own generator (the same tokens as a one-row call of the
    triton kernel with that generator; their distribution is checked in tests/ops/test_sampling.py)."""
    spy = SamplingSpy(monkeypatch)
    engine = _engine("torch")
    rids = _add(engine, MIXED)
    outs = _run(engine)
    assert len(spy.calls) == engine.num_steps == 5 and all(c["rows"] == 8 for c in spy.calls)
    for c in spy.calls:
        assert [g for g, gr in zip(c["got"], c["greedy"]) if gr] == [b for b, gr in zip(c["before"], c["greedy"]) if gr]
    assert all(outs[rid].error is None and len(outs[rid].token_ids) == 5 for rid in rids)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_seeded_request_gets_the_same_tokens_alone_and_in_a_mixed_batch(backend):
    alone = {}
    for first, params, constrained in MIXED:
        if params.seed is not None:
            engine = _engine(backend)
            (rid,) = _add(engine, [(first, params, constrained)])
            alone[first] = _run(engine)[rid].token_ids
    engine = _engine(backend)
    rids = _add(engine, MIXED)
    outs = _run(engine)
    for rid, (first, params, _) in zip(rids, MIXED):
        if params.seed is not None:
            assert outs[rid].token_ids == alone[first], first
    # and another seed changes a sampled request's tokens
    engine = _engine(backend)
    (rid,) = _add(engine, [(103, dataclasses.replace(MIXED[2][1], seed=99), False)])
    assert _run(engine)[rid].token_ids != alone[103]


def test_a_grammar_error_fails_its_request_only_and_the_step_still_samples_once(monkeypatch):
    spy = SamplingSpy(monkeypatch)
    engine = _engine("torch", fail_mask_at={106: 2})  # request 106's mask fails at its third token
    rids = _add(engine, MIXED)
    outs = _run(engine)
    assert len(spy.calls) == engine.num_steps == 5
    assert [c["rows"] for c in spy.calls] == [8, 8, 7, 7, 7]
    failed = outs[rids[5]]
    assert failed.finish_reason == "error" and "stand-in failure" in failed.error and len(failed.token_ids) == 2
    assert all(outs[r].error is None and len(outs[r].token_ids) == 5 for i, r in enumerate(rids) if i != 5)


def test_an_all_greedy_unconstrained_step_takes_the_argmax_without_the_sampling_call(monkeypatch):
    """Every row greedy, unconstrained and without penalties (logprobs asked by one): the step's
    tokens are the argmax ``ops.sample`` gives such rows, without calling it; the logprobs are
    still read from the model's distribution."""
    spy = SamplingSpy(monkeypatch)
    seen = []
    real_sample = sampler_module.Sampler.sample

    def sample(self, rows):
        got = real_sample(self, rows)
        seen.append((torch.stack([logits for _, logits, _ in rows]), [got[seq.seq_id] for seq, _, _ in rows]))
        return got

    monkeypatch.setattr(sampler_module.Sampler, "sample", sample)
    engine = _engine("torch")
    greedy = [(first, params, False) for first, params, constrained in MIXED if params.greedy and not constrained]
    greedy.append((109, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), False))
    rids = _add(engine, greedy)
    outs = _run(engine)
    assert spy.calls == [] and len(seen) == engine.num_steps == 5
    n = len(greedy)
    for logits, got in seen:
        assert got == spy.real(logits, torch.zeros(n), torch.ones(n), backend="torch").tolist()
    for i, rid in enumerate(rids):
        assert outs[rid].error is None and outs[rid].token_ids == [got[i] for _, got in seen]
    with_logprobs = [i for i, (_, p, _) in enumerate(greedy) if p.logprobs]
    assert with_logprobs and all(outs[rids[i]].logprobs and len(outs[rids[i]].logprobs) == 5 for i in with_logprobs)
    want = [float(torch.log_softmax(logits[with_logprobs[0]], -1)[got[with_logprobs[0]]]) for logits, got in seen]
    assert outs[rids[with_logprobs[0]]].logprobs == pytest.approx(want, abs=1e-6)


def test_the_greedy_path_reads_argmax_rule_for_ties_and_nan():
    """The all-greedy path takes ``row.max(0).indices`` (faster than ``argmax`` on the CPU); it must
    keep ``argmax``'s rule, which ``ops.sample`` follows for greedy rows: the first maximum on a
    tie, the first NaN when there is one (checked on the installed torch)."""
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, float("nan"), 5.0, float("nan")], [-math.inf] * 3 + [0.0]])
    for row in rows:
        assert int(row.max(0).indices) == int(row.argmax())
    assert [int(r.max(0).indices) for r in rows] == [1, 1, 3]
