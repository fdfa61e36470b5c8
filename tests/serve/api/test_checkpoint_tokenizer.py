"""A checkpoint directory serves without ``--tokenizer`` when it carries the tokenizer
(``kvtier create-checkpoint --tokenizer DIR`` writes it in, as released checkpoints ship it), and
one without gets an error that says what to pass."""

from kvtier.cli import main


def test_serve_of_a_checkpoint_without_a_tokenizer_says_to_pass_one(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(["create-checkpoint", str(ck), "--dtype", "float32"]) == 0
    capsys.readouterr()
    assert main(["serve", str(ck), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "no Kimi tokenizer" in err and "--tokenizer DIR" in err and "create-checkpoint --tokenizer" in err


def test_create_checkpoint_writes_the_tokenizer_in(tmp_path, tok_dir, capsys):
    from kvtier import LLM, SamplingParams

    ck = tmp_path / "ck"
    assert main(["create-checkpoint", str(ck), "--dtype", "float32", "--tokenizer", str(tok_dir)]) == 0
    assert "with the tokenizer of" in capsys.readouterr().out
    assert (ck / "tiktoken.model").read_bytes() == (tok_dir / "tiktoken.model").read_bytes()
    llm = LLM(str(ck), page_size=16, num_device_pages=64)  # no tokenizer argument: the directory's
    out = llm.chat([{"role": "user", "content": "hi"}], sampling_params=SamplingParams(max_tokens=2, temperature=0))
    assert len(out.token_ids) == 2 and isinstance(out.content, str)
    assert main(["create-checkpoint", str(tmp_path / "bad"), "--tokenizer", str(tmp_path)]) == 2  # no files there
    assert not (tmp_path / "bad").exists()  # refused before anything was written
