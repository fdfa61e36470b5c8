"""The resume target's step bound: the step-time model the scheduler fits, the expected returns
the pool keeps for it, and the steps it shortens (``kvtier.serve.step_time.bound_step``)."""

import math

import numpy as np
import pytest

from kvtier import LLM
from kvtier.serve.step_time import FEATURES, RESUME_STEP_SHARE, StepTimeModel, fit_nonnegative, step_features
from tests.helpers.serving import ONE, PS, prompt

BUDGET = 64
STEP_S, TOKEN_S = 0.01, 0.01  # the fixed model of the engine tests: 10 ms a step, 10 ms a prefill token
TARGET_S = 1.0
BOUND_S = RESUME_STEP_SHARE * TARGET_S  # 0.4 s


def test_fit_nonnegative_recovers_weights_and_drops_a_negative_column():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(40), rng.uniform(0, 1e4, 40), rng.uniform(0, 1e9, 40)])
    w = np.array([2e-3, 3e-6, 4e-10])
    assert fit_nonnegative(x, x @ w) == pytest.approx(w, rel=1e-6)
    # y falls with the third column: its weight would be negative, so it is dropped (0) and the rest refitted
    y = x[:, :2] @ w[:2] - 1e-10 * x[:, 2]
    got = fit_nonnegative(x, y)
    assert got[2] == 0 and (got >= 0).all()
    with pytest.raises(ValueError, match="samples"):
        fit_nonnegative(x[:2], y[:2])
    with pytest.raises(ValueError, match="samples"):
        fit_nonnegative(x, y[:-1])


def test_step_time_model_estimates_after_its_first_fit_from_both_kinds_of_step():
    truth = np.array([2e-3, 5e-6, 1e-10, 1e-4, 2e-8])
    model = StepTimeModel(window=64, refit_every=8)
    rng = np.random.default_rng(1)
    prefill = [step_features([(int(rng.integers(16, 4096)), int(rng.integers(0, 90_000)))], int(rng.integers(0, 9)),
                             int(rng.integers(0, 500_000))) for _ in range(40)]
    decode = [step_features([], int(d), int(d) * 3000) for d in rng.integers(1, 64, 40)]
    for f in prefill[:20]:  # prefill steps only: no fit yet (no decode-only steps seen)
        model.observe(f, float(f @ truth))
    assert model.estimate_s(prefill[0]) is None
    model.observe(decode[0], 0.0)  # no time: ignored
    model.observe(decode[0], math.nan)
    for f in prefill[20:] + decode:
        model.observe(f, float(f @ truth))
    assert model.weights is not None and len(model.weights) == len(FEATURES)
    for f in prefill[:5] + decode[:5]:
        assert model.estimate_s(f) == pytest.approx(float(f @ truth), rel=1e-6)
    with pytest.raises(ValueError, match="window"):
        StepTimeModel(window=4)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("policy", ["lru", "tool-aware"])
def test_pool_keeps_expected_returns_under_any_policy(policy):
    llm = LLM("tiny", page_size=PS, num_device_pages=64, cache_policy=policy)
    pool, clock = llm.engine.pool, FakeClock()
    pool.tiers.clock = clock
    pool.tool_wait("a", prompt(3 * PS, 1), expected_wait_s=10.0)
    pool.tool_wait("b", prompt(3 * PS, 2), expected_wait_s=20.0)
    assert pool.returns_within(0.5, 1.0) == 0
    clock.now = 9.5
    assert pool.returns_within(0.5, 1.0) == 1  # a due at 10
    clock.now = 10.4
    assert pool.returns_within(0.5, 0.0) == 1  # a is 0.4 s late: still counted
    clock.now = 19.5
    assert pool.returns_within(0.5, 1.0) == 1  # a is forgotten (over 0.5 s late); b due at 20
    pool.tool_return("b")
    assert pool.returns_within(0.5, 1.0) == 0
    with pytest.raises(ValueError, match="expected_wait_s"):
        pool.tool_wait("c", prompt(PS, 3), expected_wait_s=-1.0)
    assert pool.returns_within(100.0, 100.0) == 0  # a rejected wait is not kept


def fixed_model() -> StepTimeModel:
    """A model that never refits: STEP_S + TOKEN_S per prefill token."""
    model = StepTimeModel(refit_every=10**9)
    model.weights = np.array([STEP_S, TOKEN_S, 0.0, 0.0, 0.0])
    return model


def engine_with_target(target_s):
    llm = LLM("tiny", page_size=PS, num_device_pages=256, max_num_batched_tokens=BUDGET, schedule_policy="cache-aware")
    engine = llm.engine
    engine.scheduler.step_time = fixed_model()
    engine.clock = engine.scheduler.clock = lambda: 0.0  # arrival and now equal: the fixed model alone decides
    engine.set_resume_target(target_s)
    return engine


def record_chunks(engine) -> list[dict[int, int]]:
    """Each step's prefill chunks as ``{seq_id: tokens}``."""
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append({s.seq_id: n for s, n in batch.extends})
        return batch

    engine.scheduler.schedule = recording
    return steps


def run(engine, long_prompt, short_prompt, after_steps=2, on_start=None):
    """A long cold prompt, then after ``after_steps`` steps a short one; returns the outputs by
    request id, each step's chunks, and the two request ids."""
    steps = record_chunks(engine)
    long_id = engine.add_request(long_prompt, ONE)
    outs = {}
    for _ in range(after_steps):
        outs.update({o.request_id: o for o in engine.step()})
    if on_start is not None:
        on_start(engine)
    short_id = engine.add_request(short_prompt, ONE)
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return outs, steps, long_id, short_id


def estimate(chunks: dict[int, int]) -> float:
    return STEP_S + TOKEN_S * sum(chunks.values()) if chunks else 0.0


def first_token_step(steps) -> tuple[int, int, int]:
    """``(index of the step that ran the short request, long seq_id, short seq_id)``."""
    long_seq = min(s for step in steps for s in step)
    short_seq = max(s for step in steps for s in step)
    return next(i for i, step in enumerate(steps) if short_seq in step), long_seq, short_seq


def test_step_that_gives_a_first_token_is_cut_to_the_bound_and_outputs_do_not_change():
    """Target 1 s (bound 0.4 s of estimated time): the step in which a 20-token request gets its
    first token cuts the long prompt's chunk to the largest multiple of the page that fits the
    bound; the other steps run whole 64-token chunks (its last one, what is left, ends its prompt
    within the bound). Without a target the same step runs 44 tokens of the long prompt. Tokens
    equal in both runs."""
    long_prompt, short_prompt = prompt(512, 5), prompt(20, 6)
    outs, steps, long_id, short_id = run(engine_with_target(TARGET_S), long_prompt, short_prompt)
    base, base_steps, b_long, b_short = run(engine_with_target(None), long_prompt, short_prompt)
    assert outs[long_id].token_ids == base[b_long].token_ids
    assert outs[short_id].token_ids == base[b_short].token_ids
    first, long_seq, short_seq = first_token_step(steps)
    assert steps[first][short_seq] == 20  # its whole prompt: it ends there
    cut = steps[first][long_seq]
    assert cut % PS == 0 and estimate(steps[first]) <= BOUND_S < STEP_S + TOKEN_S * (20 + cut + PS)
    long_chunks = [step[long_seq] for step in steps if long_seq in step]
    assert sum(long_chunks) == 512
    assert [c for j, c in enumerate(long_chunks[:-1]) if j != first] == [BUDGET] * (len(long_chunks) - 2)
    b_first, b_long_seq, _ = first_token_step(base_steps)
    assert base_steps[b_first][b_long_seq] == BUDGET - 20


def test_a_step_already_within_the_bound_is_left_alone():
    long_prompt, short_prompt = prompt(512, 5), prompt(20, 6)
    _, steps, _, _ = run(engine_with_target(100.0), long_prompt, short_prompt)  # bound 50 s: never over
    first, long_seq, _ = first_token_step(steps)
    assert steps[first][long_seq] == BUDGET - 20
    with pytest.raises(ValueError, match="resume_ttft_s"):
        engine_with_target(0.0)
    with pytest.raises(ValueError, match="resume_ttft_s"):
        engine_with_target(math.inf)


def test_an_expected_return_cuts_steps_that_give_no_first_token():
    """A session due back from a tool wait (declared to the pool) cuts the steps around its
    expected return even when no request gets its first token in them."""
    engine = engine_with_target(TARGET_S)
    steps = record_chunks(engine)
    engine.add_request(prompt(512, 5), ONE)
    engine.step()
    assert sum(steps[-1].values()) == BUDGET
    engine.pool.tool_wait("agent", prompt(2 * PS, 9), expected_wait_s=0.0)  # due now
    engine.step()
    fits = int((BOUND_S - STEP_S) / TOKEN_S + 1e-9) // PS * PS  # the largest chunk within the bound
    assert PS <= fits < BUDGET and sum(steps[-1].values()) == fits
    engine.pool.tool_return("agent")
    engine.step()
    assert sum(steps[-1].values()) == BUDGET


def test_a_chunk_over_the_bound_that_ends_within_the_target_is_kept_whole():
    """A 30-token request takes 0.31 s in a step of its own. At a 0.6 s target (bound 0.24 s) it
    is over the bound but within the target of its arrival: it runs whole in one step (the long
    prompt beside it cut to a page). At a 0.3 s target it misses anyway and is cut like any
    chunk."""
    long_prompt, short_prompt = prompt(512, 5), prompt(30, 6)
    _, steps, _, _ = run(engine_with_target(0.6), long_prompt, short_prompt)
    first, long_seq, short_seq = first_token_step(steps)
    assert [step[short_seq] for step in steps if short_seq in step] == [30]
    assert steps[first][long_seq] == PS
    _, steps, _, _ = run(engine_with_target(0.3), long_prompt, short_prompt)
    _, _, short_seq = first_token_step(steps)
    assert len([step for step in steps if short_seq in step]) > 1
