"""Fixtures of the tool-call tests: the real Kimi vocabulary and Moonshot's tool-call data from
../shared (tests that need them skip when they are absent); ``tok`` and ``tok_dir`` are in
tests/conftest.py."""

from pathlib import Path

import pytest

from tests.conftest import SHARED

# A valid tool no finite turn can satisfy: llguidance refuses to compile its grammar.
UNGENERABLE_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"s": {"type": "string", "minLength": 999999999999}},
            "required": ["s"],
        },
    },
}

WALLE_DIR = SHARED / "toolcalls" / "walle" / "testdata" / "validator_cases"
K2VV_DIR = SHARED / "toolcalls" / "K2-Vendor-Verifier"



@pytest.fixture(scope="session")
def walle_dir() -> Path:
    if not WALLE_DIR.is_dir():
        pytest.skip(f"walle validator cases not present at {WALLE_DIR}")
    return WALLE_DIR


@pytest.fixture(scope="session")
def k2vv_dir() -> Path:
    if not (K2VV_DIR / "medium.jsonl").is_file():
        pytest.skip(f"K2-Vendor-Verifier requests not present at {K2VV_DIR}")
    return K2VV_DIR


@pytest.fixture(scope="session")
def compiler(tok):
    from kvtier.toolcall import GrammarCompiler

    return GrammarCompiler(tok, [tok.token_id("<|im_end|>"), tok.token_id("[EOS]")])


@pytest.fixture(scope="session")
def table(tok, compiler):
    from kvtier.toolcall import TokenTable

    return TokenTable(tok, compiler.end_of_turn_ids)
