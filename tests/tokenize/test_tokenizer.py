"""KimiTokenizer against the real vocabulary: known ids, Moonshot's encode semantics, decoding."""

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tokenize import StreamDecoder, load_tokenizer
from kvtier.tokenize.tokenizer import split_long_runs

from .parts import CJK, EMOJI, MINIFIED, SOURCE, SPACES, literal_split, reference_encode, text

KNOWN_SPECIAL = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
                 "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
                 "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
                 "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599,
                 "<|im_middle|>": 163601, "<think>": 163606, "</think>": 163607, "[UNK]": 163838,
                 "[PAD]": 163839}


@pytest.mark.parametrize("text_, ids", [("functions.bash:0", [41937, 1948, 1596, 25, 15]),
                                        ("assistant", [69702]), ("user", [2482]), ("system", [14062])])
def test_known_ids(tok, text_, ids):
    assert tok.encode(text_) == ids


def test_vocab_and_special_ids(tok):
    assert tok.n_vocab == 163840
    for s, i in KNOWN_SPECIAL.items():
        assert tok.token_id(s) == i
        assert tok.encode(s) == [i]
        assert tok.decode([i]) == s
    assert tok.encode("<|reserved_token_163700|>") == [163700]
    assert len(tok.special_tokens) == 256


def test_special_strings_in_text(tok):
    ids = tok.encode("a<|im_end|>b")
    assert ids == tok.encode("a") + [163586] + tok.encode("b")
    plain = tok.encode("a<|im_end|>b", allow_special=False)
    assert 163586 not in plain and tok.decode(plain) == "a<|im_end|>b"
    assert tok.encode("<|im_end") == tok.encode("<|im_end", allow_special=False)  # partial: ordinary text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab \n\t\u3000x"), max_size=60), st.integers(1, 7))
def test_split_long_runs_matches_moonshot_loop(s, max_run):
    assert split_long_runs(s, max_run) == list(literal_split(s, max_run))


@pytest.mark.parametrize("s", [MINIFIED, SPACES, "x" * 25_000, "x" * 25_001, "x" * 75_001 + " " * 50_002 + "y",
                               SOURCE * 300 + "z" * 30_000 + CJK])
def test_long_runs_match_reference(tok, s):
    assert tok.encode(s) == reference_encode(tok, s)


def test_long_run_split_changes_ids(tok):
    """The 25,000 cut is real: a 30,000-char run does not encode as tiktoken alone would."""
    s = "abc" * 10_000
    assert tok.encode(s) != tok._enc.encode_ordinary(s)


def test_windows_per_segment(tok):
    """A 400,000-char window restarts at every special token (segments), not at the text start."""
    seg = ("word " * 90_000)[:-1]  # 449,999 chars: one window cut inside
    s = "x" * 7 + "<|im_end|>" + seg
    assert tok.encode(s) == reference_encode(tok, s)
    assert tok.encode(s)[len(tok.encode("x" * 7)) + 1:] == tok.encode(seg)


@settings(max_examples=60, deadline=None)
@given(text())
def test_encode_matches_reference_and_roundtrips(tok, s):
    ids = tok.encode(s)
    assert ids == reference_encode(tok, s)
    assert tok.decode(ids) == s


@settings(max_examples=100, deadline=None)
@given(text(allow_long=False), st.lists(st.integers(0, 163839), max_size=20))
def test_stream_decode_equals_decode(tok, s, extra):
    ids = tok.encode(s) + extra  # arbitrary ids can split characters or never complete them
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.finish() == tok.decode(ids)
    assert all("\ufffd" not in p or "\ufffd" in tok.decode(ids) for p in pieces)


def test_stream_decode_holds_partial_characters(tok):
    ids = tok.encode(EMOJI + CJK)
    dec = StreamDecoder(tok)
    out = ""
    for i in ids:
        piece = dec.push(i)
        assert "\ufffd" not in piece
        out += piece
    assert out + dec.finish() == EMOJI + CJK
    # an emoji split byte by byte: nothing comes out until its last byte
    byte_ids = [tok._enc.encode_single_token(bytes([b])) for b in "🚀".encode()]
    dec = StreamDecoder(tok)
    assert [dec.push(i) for i in byte_ids] == ["", "", "", "🚀"]


def test_missing_vocab_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tiktoken.model")):
        load_tokenizer(tmp_path)


def test_bad_config(tmp_path, tok_dir):
    shutil.copy(tok_dir / "tiktoken.model", tmp_path / "tiktoken.model")
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[BOS]"}))
    with pytest.raises(ValueError, match="added_tokens_decoder"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "x"}}}))
    with pytest.raises(ValueError, match="outside the special range"):
        load_tokenizer(tmp_path)


def test_bad_vocab(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not-base64!! zero\n")
    with pytest.raises(ValueError, match="tiktoken.model"):
        load_tokenizer(tmp_path)
