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
    # an empty conversation is refused, as the server refuses messages=[] (it generated from the
    # template's default system prompt alone, and in a session dropped the whole history)
    with pytest.raises(ValueError, match="messages: empty"):
        llm.chat([])
    with pytest.raises(ValueError, match="messages: empty"):
        llm.chat((), session_id="s-empty")


def test_chat_hands_the_buffer_hashes_to_the_prefix_lookup(llm, monkeypatch):
    """The engine hashes only pages the session's token buffer has not hashed yet."""
    from kvtier import SamplingParams
    from kvtier.cache import block_hashes, prefix_reuse

    hashed = []
    real = prefix_reuse.block_hashes  # where the pool hashes a request's blocks
    monkeypatch.setattr(prefix_reuse, "block_hashes", lambda ids, *a, **k: hashed.append(len(ids)) or real(ids, *a, **k))
    ps = llm.engine.config.pool.page_size
    msgs = [{"role": "user", "content": "Summarise this file:\n" + "def f(x):\n    return x * 2\n" * 40}]
    out = llm.chat(msgs, sampling_params=SamplingParams(max_tokens=2, temperature=0), session_id="hashes")
    enc = llm._sessions["hashes"]
    assert len(out.prompt_token_ids) >= 4 * ps
    assert enc.block_hashes() == block_hashes(out.prompt_token_ids, ps, salt=llm.engine.block_hash_salt)
    # the lookup needs (len - 1) // ps pages; the buffer had len // ps of them: nothing left to hash
    assert sum(hashed) <= ps
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and again"}]
    out2 = llm.chat(msgs, sampling_params=SamplingParams(max_tokens=2, temperature=0), session_id="hashes")
    assert out2.num_cached_tokens >= (len(out.prompt_token_ids) // ps - 1) * ps  # the first turn's pages were reused


def test_add_request_rejects_hashes_that_do_not_match(llm):
    import numpy as np

    from kvtier import SamplingParams
    from kvtier.cache import block_hashes

    eng, ps = llm.engine, llm.engine.config.pool.page_size
    prompt = np.arange(1000, 1000 + 3 * ps + 5, dtype=np.uint32)
    params = SamplingParams(max_tokens=1)
    good = block_hashes(prompt, ps, salt=eng.block_hash_salt)
    for bad, match in [(block_hashes(prompt, ps), "does not match"),           # no salt
                       (good + [good[0]], "at most 3 full pages"),             # too many
                       (good[:1] + [b"short"], "16 bytes"),
                       (good[0], "expected a list")]:                      # one hash, not a list
        with pytest.raises(ValueError, match="prompt_block_hashes.*" + match):
            eng.add_request(prompt, params, prompt_block_hashes=bad)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]\[2\]"):
        eng.add_request(np.array([5, 6, -1]), params)
    assert not eng.has_unfinished()  # nothing was queued


def test_end_session_drops_the_encoder_and_a_later_chat_starts_afresh(llm):
    from kvtier import SamplingParams

    msgs = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.chat(msgs, sampling_params=params, session_id="ended")
    first = llm._sessions["ended"]
    assert llm.end_session("ended") is True
    assert "ended" not in llm._sessions
    assert llm.end_session("ended") is False  # unknown ids are not an error
    assert llm.end_session(None) is False
    out = llm.chat(msgs, sampling_params=params, session_id="ended")
    assert llm._sessions["ended"] is not first
    assert out.prompt_token_ids == llm.tokenizer.encode(render_chat(msgs))
    llm.end_session("ended")
