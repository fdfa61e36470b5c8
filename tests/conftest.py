"""Session-wide test setup.

Triton decides interpreted-vs-compiled when a function is decorated, and that includes its own
standard library (``tl.sum``, ``tl.max``, ``tl.cdiv`` are ``@triton.jit`` functions decorated when
triton is first imported). So on a machine without a GPU the interpreter is switched on here,
before anything imports triton; the dispatcher reads ``TRITON_INTERPRET`` at call time, so a test
can still delete it to see the CPU-without-interpreter behaviour. On a GPU machine it is left
alone and the Triton tests run compiled kernels.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (scripts/test.sh runs one worker per core) each worker computes on one thread:
# two workers of two threads each on two cores spend their time spinning on each other.
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    torch.set_num_threads(1)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"  # ../shared beside the repository
TOKENIZER_DIR = SHARED / "kimi_tokenizer"


@pytest.fixture(scope="session")
def tok_dir() -> Path:
    """The real Kimi tokenizer files (tiktoken.model + tokenizer_config.json); skips without them."""
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def tok(tok_dir):
    """The Kimi tokenizer loaded from :func:`tok_dir`."""
    from kvtier.tokenize import load_tokenizer

    return load_tokenizer(tok_dir)


@pytest.fixture(scope="session")
def k3_tok_dir(tok_dir, tmp_path_factory) -> Path:
    """Kimi K3's tokenizer files: the real BPE vocabulary with K3's ``tokenizer_config.json``
    (its control tokens, as ``kvtier create-checkpoint --tokenizer`` writes them for a K3 model)."""
    from kvtier.tokenize import ChatFormat, copy_tokenizer

    return copy_tokenizer(tok_dir, tmp_path_factory.mktemp("k3_tokenizer"), chat_format=ChatFormat.K3_XTML)


@pytest.fixture(scope="session")
def k3_tok(k3_tok_dir):
    """The K3 tokenizer loaded from :func:`k3_tok_dir` (``chat_format`` ``K3_XTML``)."""
    from kvtier.tokenize import load_tokenizer

    return load_tokenizer(k3_tok_dir)


@pytest.fixture
def tool_call_parsers(monkeypatch):
    """Every :class:`kvtier.toolcall.ToolCallParser` built while the test runs, in order (however
    it is built: ``for_tokenizer`` or the class itself; in this process only)."""
    from kvtier.toolcall import ToolCallParser

    made, real = [], ToolCallParser.__post_init__

    def counted(self):
        made.append(self)
        real(self)

    monkeypatch.setattr(ToolCallParser, "__post_init__", counted)
    return made


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (wider sweeps)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only with ``--run-slow`` or when ``-m`` selects them explicitly."""
    import pytest

    if not (config.getoption("--run-slow") or "slow" in (config.getoption("-m") or "")):
        skip = pytest.mark.skip(reason="slow: pass --run-slow (or -m slow) to run")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    if torch.cuda.is_available():  # the interpreter tests need TRITON_INTERPRET before triton's import
        skip_interp = pytest.mark.skip(reason="interpreter test: run on a CPU-only machine (GPUs: pytest -m gpu)")
        for item in items:
            if "_interpret" in item.fixturenames or "_interpreter" in item.fixturenames:
                item.add_marker(skip_interp)
