"""LLM.chat: the tiny preset with the real Kimi tokenizer, one encoder per session."""

import pytest

from kvtier.tokenize import render_chat


@pytest.fixture(scope="module")
def llm(tok_dir):
    from kvtier import LLM

    return LLM("tiny", tokenizer=tok_dir, num_device_pages=256)


def test_chat_encodes_the_rendered_conversation(llm):
    from kvtier import SamplingParams

    msgs = [{"role": "user", "content": "写一个 hello world"}]
    out = llm.chat(msgs, sampling_params=SamplingParams(max_tokens=3), session_id="s1")
    assert out.prompt_token_ids == llm.tokenizer.encode(render_chat(msgs))
    assert len(out.token_ids) == 3
    msgs += [{"role": "assistant", "content": llm.tokenizer.decode(out.token_ids)}, {"role": "user", "content": "again"}]
    out2 = llm.chat(msgs, sampling_params=SamplingParams(max_tokens=2), session_id="s1")
    assert out2.prompt_token_ids == llm.tokenizer.encode(render_chat(msgs))


def test_chat_errors(llm, tok_dir):
    from kvtier import LLM

    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        llm.chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM("tiny", num_device_pages=16).chat([{"role": "user", "content": "x"}])
