"""One block-hash pass per turn: each full page of a chat's tokens is hashed once, where its tokens
are appended (the session encoder's token buffer for the prompt, the pool for the output), and
the engine's admission, the pool and the server's tool-wait path read those hashes."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier import LLM, SamplingParams
from kvtier.cache import block_hash, block_hashes_py
from kvtier.serve.api.sessions import SessionStore
from kvtier.serve.chat import add_chat_request
from kvtier.serve.intake import request_salt
from kvtier.tokenize.buffer import TokenBuffer

PS = 16
PARAMS = SamplingParams(max_tokens=2 * PS + 3, temperature=0.0, ignore_eos=True)


class HashCounter:
    """Every block hashed, by where: ``pool`` (any ``kvtier._C.block_hashes`` call: the pool, the
    engine's check of a hash list, a tool wait) and ``buffer`` (pages a token buffer's append
    completed), with the hashes each produced."""

    def __init__(self, monkeypatch):
        self.pool: list[bytes] = []
        self.pool_parents: list[bytes | None] = []
        self.buffer: list[bytes] = []
        native = block_hash._C.block_hashes
        append = TokenBuffer.append

        def counted_block_hashes(arr, page_size, parent, salt):
            out = native(arr, page_size, parent, salt)
            if out:
                self.pool_parents.append(parent)
            self.pool += out
            return out

        def counted_append(buf, ids):
            before = buf.num_blocks
            append(buf, ids)
            self.buffer += buf.block_hashes(before)

        monkeypatch.setattr(block_hash._C, "block_hashes", counted_block_hashes)
        monkeypatch.setattr(TokenBuffer, "append", counted_append)

    def take(self) -> tuple[list[bytes], list[bytes], list]:
        out = self.pool, self.buffer, self.pool_parents
        self.pool, self.buffer, self.pool_parents = [], [], []
        return out


@pytest.fixture(scope="module")
def llm(tok_dir):
    return LLM("tiny", tokenizer=tok_dir, page_size=PS, num_device_pages=64)


def _turns():
    msgs = [{"role": "system", "content": "You answer briefly. " * 6},
            {"role": "user", "content": "List the files in the current directory, please. " * 3}]
    yield msgs
    yield [{"role": "user", "content": "And now the hidden ones too, sorted by size. " * 4}]
    yield [{"role": "user", "content": "Thanks. Which one is the largest?"}]


def test_each_page_of_a_multi_turn_chat_is_hashed_once(llm, monkeypatch):
    count = HashCounter(monkeypatch)
    salt = llm.engine.block_hash_salt + request_salt("")
    conversation, seen, kept = [], set(), 0
    for turn, new in enumerate(_turns()):
        conversation += new
        out = llm.chat(conversation, sampling_params=PARAMS, session_id="s")
        enc = llm._sessions["s"]
        pool, buffer, parents = count.take()
        prompt = np.asarray(enc.ids)
        n_prompt = len(prompt) // PS
        ids = list(prompt) + list(out.token_ids)
        chain = block_hashes_py(ids, PS, salt=salt)

        # The buffer hashed only the pages this turn appended (the earlier ones were kept) ...
        assert buffer == chain[kept:n_prompt], f"turn {turn}"
        # ... and the pool only the output's pages: it started from the prompt's last page and
        # hashed each page of the computed tokens (all but the last sampled one) once.
        n_computed = (len(ids) - 1) // PS
        assert pool == chain[n_prompt:n_computed], f"turn {turn}"
        assert parents[:1] == ([chain[n_prompt - 1]] if pool else []), f"turn {turn}"  # one call per filled step
        assert n_computed > n_prompt  # the output filled pages: the pool's share is not empty
        # Nothing of an earlier turn's prompt was hashed again.
        assert not seen & set(buffer + pool), f"turn {turn}"
        seen |= set(chain[:n_prompt])
        # The turn reused the previous turns' cached pages these hashes name.
        if turn:
            assert out.num_cached_tokens >= kept * PS > 0
        conversation.append({"role": "assistant", "content": out.content})
        kept = n_prompt
    llm.end_session("s")


def test_a_token_buffer_of_another_salt_page_size_or_prompt_is_refused(llm):
    eng = llm.engine
    enc_ids = list(range(100, 100 + 3 * PS + 5))
    good = TokenBuffer(PS, eng.block_hash_salt + request_salt("t"))
    good.append(enc_ids)
    for buf, ids, cache_salt, match in [
        (good, enc_ids, "", "salt"),  # built for tenant "t", queued for no tenant
        (good, enc_ids[:-1], "t", "ids"),
        (good, [7] + enc_ids[1:], "t", "ids"),
    ]:
        with pytest.raises(ValueError, match=f"prompt_block_hashes for prompt 0: .*{match}"):
            eng.add_request(np.asarray(ids), PARAMS, prompt_block_hashes=buf, cache_salt=cache_salt)
    other_ps = TokenBuffer(PS * 2, eng.block_hash_salt + request_salt("t"))
    other_ps.append(enc_ids)
    with pytest.raises(ValueError, match="page_size"):
        eng.add_request(np.asarray(enc_ids), PARAMS, prompt_block_hashes=other_ps, cache_salt="t")
    assert not eng.has_unfinished()
    rid = eng.add_request(np.asarray(enc_ids), PARAMS, prompt_block_hashes=good, cache_salt="t")
    assert eng.sequence(rid).block_hashes == block_hashes_py(enc_ids, PS, salt=good.salt)
    while eng.has_unfinished():
        eng.step()


def test_a_tool_wait_hashes_only_the_pages_the_request_did_not(llm, monkeypatch):
    """The server's session path: a turn that ends in a tool call tells the pool its blocks from
    the hashes the request already has; only pages past them (the last sampled token's) are
    hashed."""
    eng = llm.engine
    store = SessionStore(eng, llm.tokenizer, ttl_s=60)
    waits = []
    monkeypatch.setattr(eng.pool, "tool_wait_blocks", lambda sid, hashes, s: waits.append(hashes))
    enc = store.encoder("a", cache_salt="t")
    rid = add_chat_request(eng, enc, [{"role": "user", "content": "Run ls. " * 9}], PARAMS, cache_salt="t")
    store.accepted("a")
    seq = eng.sequence(rid)
    prompt, known = list(seq.prompt_token_ids), seq.block_hashes  # the pool extends this list
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    ids = prompt + list(outs[0].token_ids)
    count = HashCounter(monkeypatch)
    store.turn_ended("a", ids, ["ls"], None, None, known)
    pool, buffer, _ = count.take()
    chain = block_hashes_py(ids, PS, salt=eng.block_hash_salt + request_salt("t"))
    assert waits == [chain]
    assert pool == chain[len(known):] and buffer == []
    assert len(known) >= (len(ids) - 1) // PS  # all the request's computed pages were known
    store.end("a")
