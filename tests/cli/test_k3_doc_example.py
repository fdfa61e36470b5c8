"""docs/k3.md's create-checkpoint example, run as written: ``kvtier create-checkpoint DIR --preset
tiny-k3 --dtype mxfp4 --tokenizer ../shared/kimi_tokenizer`` from the repository root, then
``kvtier serve DIR`` (on a free port) answers a chat request through the openai SDK with no other
flag."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from kvtier.cli import main
from tests.conftest import TOKENIZER_DIR
from tests.serve.api.conftest import start_listening

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "k3.md"


def _example() -> list[list[str]]:
    text = DOC.read_text()
    block = text[text.index("<!-- k3-create-checkpoint"):].split("```\n", 2)[1]
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def test_the_example_is_create_checkpoint_then_serve():
    lines = _example()
    assert [line[:2] for line in lines] == [["kvtier", "create-checkpoint"], ["kvtier", "serve"]]
    assert lines[1] == ["kvtier", "serve", "DIR"]  # no --tokenizer: the directory has its own


def test_the_create_checkpoint_example_serves_as_written(tmp_path, monkeypatch):
    if not (TOKENIZER_DIR / "tiktoken.model").is_file():
        pytest.skip(f"real Kimi tokenizer files not present at {TOKENIZER_DIR}")
    import openai

    out = tmp_path / "k3"
    create, serve = [[str(out) if a == "DIR" else a for a in line[1:]] for line in _example()]
    monkeypatch.chdir(ROOT)  # the example's ../shared/kimi_tokenizer is relative to the repository
    assert main(create) == 0
    assert (out / "tokenizer_config.json").is_file() and (out / "tiktoken.model").is_file()
    log = tmp_path / "server.log"
    proc, url = start_listening([*serve, "--host", "127.0.0.1", "--port", "0"], log)
    try:
        assert url is not None, log.read_text(errors="replace")[-3000:]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=str(out), messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(errors="replace")
