"""The chat format comes from the model's files: K3's tokenizer_config.json (its control tokens at
163586-163589) makes a tokenizer speak XTML, K2's the K2 template; create-checkpoint writes K3's
config for a ``kimi_k3`` model and nothing past the vocabulary."""

import json

import pytest

from kvtier.cli import main
from kvtier.tokenize import K3_CONTROL_TOKENS, ChatFormat, choose_chat_format, copy_tokenizer, load_tokenizer
from kvtier.tokenize.formats import model_chat_format


@pytest.fixture(scope="module")
def k3_dir(tok_dir, tmp_path_factory):
    return copy_tokenizer(tok_dir, tmp_path_factory.mktemp("k3tok"), chat_format=ChatFormat.K3_XTML)


def test_k2_files_speak_the_template(tok):
    assert tok.chat_format is ChatFormat.K2_TEMPLATE


def test_k3_files_speak_xtml(k3_dir):
    k3 = load_tokenizer(k3_dir)
    assert k3.chat_format is ChatFormat.K3_XTML
    for token, i in K3_CONTROL_TOKENS.items():
        assert k3.token_id(token) == i and k3.encode(token) == [i] and k3.decode([i]) == token
    assert k3.n_vocab == 163840
    assert "<|im_end|>" not in k3.special_tokens and "<|im_user|>" not in k3.special_tokens


def test_k3_config_has_nothing_past_the_vocab(k3_dir):
    config = json.loads((k3_dir / "tokenizer_config.json").read_text())
    ids = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    assert ids == {i: t for t, i in K3_CONTROL_TOKENS.items()}
    assert max(ids) < 163840 and "chat_template" not in config


def test_half_a_k3_config_is_refused():
    with pytest.raises(ValueError, match="special_tokens: K3's message tokens"):
        choose_chat_format({"<|open|>": 163587, "<|close|>": 163588})
    with pytest.raises(ValueError, match="special_tokens"):
        choose_chat_format({"<|end_of_msg|>": 1, "<|open|>": 2, "<|close|>": 3, "<|sep|>": 4})


def test_model_type_chooses_the_format_not_the_preset_name():
    from kvtier.model.config import preset

    assert model_chat_format(preset("tiny-k3").model_type) is ChatFormat.K3_XTML
    assert model_chat_format(preset("kimi-k3").model_type) is ChatFormat.K3_XTML
    assert model_chat_format(preset("kimi-linear-48b").model_type) is ChatFormat.K2_TEMPLATE
    assert model_chat_format(preset("tiny").model_type) is ChatFormat.K2_TEMPLATE
    with pytest.raises(ValueError, match="model_type"):
        model_chat_format(None)


def test_k3_tokenizer_cannot_be_copied_as_k2(k3_dir, tmp_path):
    with pytest.raises(ValueError, match="K3 tokenizer config"):
        copy_tokenizer(k3_dir, tmp_path / "x", chat_format=ChatFormat.K2_TEMPLATE)
    with pytest.raises(ValueError, match="chat_format"):
        copy_tokenizer(k3_dir, tmp_path / "y", chat_format="k3-xtml")


def test_create_checkpoint_of_a_k3_model_writes_k3_files(tmp_path, tok_dir, capsys):
    ck = tmp_path / "ck"
    assert main(["create-checkpoint", str(ck), "--preset", "tiny-k3", "--dtype", "float32",
                 "--tokenizer", str(tok_dir)]) == 0
    assert "k3-xtml chat format" in capsys.readouterr().out
    assert (ck / "tiktoken.model").read_bytes() == (tok_dir / "tiktoken.model").read_bytes()
    assert load_tokenizer(ck).chat_format is ChatFormat.K3_XTML


def test_a_k3_model_with_k2s_files_gets_k3s_control_tokens(tok_dir, k3_tok_dir):
    """The model's config chooses: a K3 model served with K2's tokenizer directory (the same BPE
    ranks) speaks XTML; K3's files for a K2 model are refused."""
    k3 = load_tokenizer(tok_dir, ChatFormat.K3_XTML)
    assert k3.chat_format is ChatFormat.K3_XTML
    assert k3.special_tokens == load_tokenizer(k3_tok_dir).special_tokens
    assert load_tokenizer(tok_dir, ChatFormat.K2_TEMPLATE).chat_format is ChatFormat.K2_TEMPLATE
    with pytest.raises(ValueError, match="K3's control tokens, but the model speaks K2's chat template"):
        load_tokenizer(k3_tok_dir, ChatFormat.K2_TEMPLATE)


def test_llm_of_the_k3_preset_renders_xtml(tok_dir):
    from kvtier import LLM, SamplingParams
    from kvtier.tokenize.xtml import XtmlOptions, encode_xtml

    llm = LLM("tiny-k3", tokenizer=tok_dir, num_device_pages=64)  # K2's files, a K3 config
    assert llm.tokenizer.chat_format is ChatFormat.K3_XTML
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, sampling_params=SamplingParams(max_tokens=1, temperature=0), reasoning_effort="max")
    assert list(out.prompt_token_ids) == encode_xtml(llm.tokenizer, messages, None, XtmlOptions(thinking_effort="max"))
    k2 = LLM("tiny", tokenizer=tok_dir, num_device_pages=64)
    with pytest.raises(ValueError, match="K3's prompt fields"):
        k2.chat(messages, reasoning_effort="max")
