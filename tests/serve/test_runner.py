"""The runner plans each step once (the step's one host read of its metadata) and hands the model a
planned batch, whose layers then read no device value on the host (``tests/model/test_compile.py``
traces such a forward whole)."""

from __future__ import annotations

from kvtier import LLM, SamplingParams


def test_runner_plans_once_per_step(monkeypatch):
    llm = LLM("tiny", dtype="float32", page_size=4, num_device_pages=64, max_num_batched_tokens=16)
    runner, model = llm.engine.runner, llm.engine.runner.model
    steps, plans, forwards = [], [], []
    run, plan, forward = runner.run, model.plan, model.forward
    monkeypatch.setattr(runner, "run", lambda batch: steps.append(batch) or run(batch))
    monkeypatch.setattr(model, "plan", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])
    monkeypatch.setattr(model, "forward", lambda ids, pos, batch, caches: forwards.append(batch) or forward(
        ids, pos, batch, caches))
    prompts = [list(range(1, 21)), list(range(30, 35))]
    out = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4, temperature=0.0))
    assert [len(o.token_ids) for o in out] == [4, 4]
    assert len(steps) == len(plans) == len(forwards) >= 5  # 25 prompt tokens in chunks of 16, then decodes
    assert all(f.planned and f is p for f, p in zip(forwards, plans, strict=True))
    assert any(p.extend_plan is not None for p in plans) and any(p.decode_plan is not None for p in plans)
