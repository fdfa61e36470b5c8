"""Fixtures for the tokenizer tests: the real Kimi vocabulary from ../shared/kimi_tokenizer."""

from pathlib import Path

import pytest

TOKENIZER_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "kimi_tokenizer"


@pytest.fixture(scope="session")
def tok_dir() -> Path:
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def tok(tok_dir):
    from kvtier.tokenize import load_tokenizer

    return load_tokenizer(tok_dir)
