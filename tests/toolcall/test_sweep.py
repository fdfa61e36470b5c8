"""The full validity sweep (slow: about 10 minutes per seed and temperature on two CPU cores):
every K2-Vendor-Verifier request and a tool from every valid walle schema, constrained, with the
tiny random model at temperatures 0 and 1 over two weight/sampling seeds."""

import pytest

from tests.toolcall.sweep import k2vv_cases, run, walle_cases

# Valid per Kimi's validator but beyond generation: a string of at least 999,999,999,999
# characters (llguidance rejects the counted repetition; no max_tokens could hold it anyway).
UNGENERABLE = {"TestRangeConstraints:2"}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_call_is_complete_and_schema_valid(
    tok_dir, k2vv_dir, walle_dir, seed, temperature
):
    from kvtier import LLM

    llm = LLM("tiny", tokenizer=tok_dir, seed=seed, num_device_pages=4096)
    for cases in (k2vv_cases(), walle_cases()):
        tally = run(llm, cases, temperature, seed)
        failed = {name for name, _ in tally.failures}
        assert failed <= UNGENERABLE, tally.failures
        assert tally.outcomes["error"] == len(failed & {c.name for c in cases})
        assert tally.complete == tally.requests - tally.outcomes["error"]
        assert tally.valid_calls == tally.calls >= tally.complete
