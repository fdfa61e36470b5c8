"""Kimi K3's output parser: it agrees with vLLM 0.32's ``kimi_k3`` parsers on every call of a
generated corpus (random and adversarial outputs, whole and streamed, as text and as ids), and
render -> parse -> render (K3's renderer, ``kvtier.tokenize.xtml``) gives back the same turn."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.toolcall import ContentDelta, ReasoningDelta, ToolCall, ToolCallProblem
from kvtier.toolcall.xtml_parser import XtmlParser, opened_channel
from kvtier.tokenize.xtml import XtmlOptions, encode_part, generation_prompt, render_xtml_parts

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
SEED = 20261207
N_RANDOM, N_ADVERSARIAL = 160, 100
# Text pieces of names, keys, values and prose: escapes, "<" and "<|" that are no marker, quotes,
# non-ASCII, JSON look-alikes, whitespace. Marker spellings in values are the one thing left
# out: vLLM reads text, where a value holding "<|close|>argument<|sep|>" is a closing marker
# (its documented limitation); the id-level test below covers them.
PIECES = ['a', 'path', ' ', '\n', '\t', '"', "&", "&quot;", "&amp;", "<", ">", "<|", "|>", "<b>", "中文", "🔍",
          "é", "{", "}", "[1]", "true", "null", "42", "-0.5e3", "\\", "\\n", "'", "=", "key=\"v\"", "x" * 40]


def turn_segments(message: dict, thinking: bool) -> list[tuple[str, bool]]:
    """K3's renderer's segments of assistant ``message`` (``<|open|>message`` ... ``<|end_of_msg|>``)."""
    conversation = [{"role": "user", "content": "go"}, {"role": "assistant", **message}]
    return list(render_xtml_parts(conversation, None, XtmlOptions(thinking=thinking),
                                  add_generation_prompt=False).messages[-1])


def generated(message: dict, thinking: bool) -> list[tuple[str, bool]]:
    """What the model writes for ``message`` after the generation prompt (which opened ``think``
    or ``response``)."""
    return turn_segments(message, thinking)[len(generation_prompt(thinking)):]


def as_text(segments) -> str:
    return "".join(text for text, _ in segments)


def as_ids(segments, tokenizer) -> list[int]:
    return encode_part(tokenizer, segments)


def _s(rng: random.Random, lo: int = 0, hi: int = 6) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(lo, hi)))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "str", "int", "float", "bool", "null", "obj", "arr"] if depth < 2 else
                      ["str", "int", "float", "bool", "null"])
    if kind == "str":
        return _s(rng)
    if kind == "int":
        return rng.randint(-10**12, 10**12)
    if kind == "float":
        return rng.uniform(-1e6, 1e6)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "obj":
        return {_s(rng, 1, 3): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _message(rng: random.Random) -> dict:
    calls = []
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        args = {_s(rng, 1, 3): _value(rng) for _ in range(rng.randint(0, 4))}
        calls.append({"name": _s(rng, 1, 3), "arguments": json.dumps(args, ensure_ascii=False)})
    return {"reasoning_content": _s(rng, 0, 8), "content": _s(rng, 0, 8), "tool_calls": calls}


def _adversarial(rng: random.Random, message: dict, thinking: bool) -> str:
    """One structural perturbation of a rendered turn."""
    text = as_text(generated(message, thinking))
    kind = rng.randrange(9)
    if kind == 0:  # cut anywhere
        return text[:rng.randrange(len(text))]
    if kind == 1:  # whitespace inside markers (an output detokenized with spaces between specials)
        return text.replace("<|open|>tools", "<|open|> tools ").replace("argument<|sep|>", "argument <|sep|>")
    if kind == 2:  # an argument without its type attribute (a string by default)
        return text.replace(' type="number"', "", 1).replace(' type="string"', "", 1)
    if kind == 3:  # a call without its tool attribute (dropped)
        return text.replace('<|open|>call tool="', '<|open|>call name="', 1)
    if kind == 4:  # a number that is not JSON (kept as text)
        return text.replace('type="number"<|sep|>', 'type="number"<|sep|>1.2.3x', 1)
    if kind == 5:  # text between tags
        return text.replace("<|close|>call<|sep|>", "<|close|>call<|sep|>\n  ").replace(
            "<|close|>argument<|sep|>", "<|close|>argument<|sep|>\n")
    if kind == 6:  # attributes in another order, and one more
        return text.replace('<|open|>call tool="', '<|open|>call index="9" extra="&amp;" tool="')
    if kind == 7:  # the response channel never closed before the tools
        return text.replace("<|close|>response<|sep|><|open|>tools", "<|open|>tools", 1)
    # a call closed inside an open argument (the argument is dropped)
    return text.replace("<|close|>argument<|sep|><|close|>call", "<|close|>call", 1)


def corpus() -> list[dict]:
    rng = random.Random(SEED)
    cases = []
    for i in range(N_RANDOM + N_ADVERSARIAL):
        thinking = rng.random() < 0.5
        message = _message(rng)
        well_formed = i < N_RANDOM
        text = as_text(generated(message, thinking)) if well_formed else _adversarial(rng, message, thinking)
        cuts = sorted(rng.sample(range(1, max(2, len(text))), k=min(max(1, len(text) - 1), 12)))
        cases.append({"text": text, "thinking": thinking, "chunks": cuts, "well_formed": well_formed,
                      "message": message})
    return cases


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return corpus()


@pytest.fixture(scope="module")
def vllm_results(cases) -> list[dict]:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"vLLM's venv not present at {VLLM_PYTHON} (scripts/setup_vllm.sh builds it)")
    # vLLM's text ends before the stop token (it stops on <|end_of_msg|> and does not detokenize it)
    sent = [{"text": c["text"].removesuffix("<|end_of_msg|>"), "thinking": c["thinking"], "chunks": c["chunks"]}
            for c in cases]
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "toolcall" / "vllm_k3_reference.py")],
                         input=json.dumps(sent), capture_output=True, text=True, timeout=600)
    if run.returncode != 0 and ("ModuleNotFoundError" in run.stderr or "ImportError" in run.stderr):
        pytest.skip(f"vLLM 0.32's kimi_k3 parsers do not import in {VLLM_PYTHON}: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def k3_tok(tok_dir, tmp_path_factory):
    from kvtier.tokenize import ChatFormat, copy_tokenizer, load_tokenizer

    return load_tokenizer(copy_tokenizer(tok_dir, tmp_path_factory.mktemp("k3tok"), chat_format=ChatFormat.K3_XTML))


def _calls(parser: XtmlParser) -> list[list[str]]:
    return [[c.name, c.arguments] for c in parser.tool_calls]


def _parse_text(case: dict, chunks=None) -> XtmlParser:
    p = XtmlParser(channel="think" if case["thinking"] else "response")
    text = case["text"]
    cuts = [0, *(chunks or []), len(text)]
    for a, b in zip(cuts, cuts[1:]):
        p.feed_text(text[a:b])
    p.finish()
    return p


def test_corpus_size_and_mix(cases):
    assert len(cases) >= 200
    calls = sum(len(c["message"]["tool_calls"]) for c in cases)
    assert calls >= 250 and sum(c["thinking"] for c in cases) >= 80


def test_every_call_agrees_with_vllm(cases, vllm_results):
    agreed = 0
    for i, (case, ref) in enumerate(zip(cases, vllm_results)):
        whole = _parse_text(case)
        assert _calls(whole) == ref["calls"], (i, case["text"])
        assert ref["stream_calls"] == ref["calls"], (i, "vLLM's streamed calls differ from its own whole parse")
        assert _calls(_parse_text(case, case["chunks"])) == ref["calls"], (i, case["text"])
        if case["well_formed"]:
            assert (whole.content or None) == ref["content"], (i, case["text"])
        agreed += len(ref["calls"])
    assert agreed >= 250  # calls compared, not only empty outputs


def test_ids_streamed_one_token_at_a_time_agree(cases, vllm_results, k3_tok):
    for i, (case, ref) in enumerate(zip(cases, vllm_results)):
        ids = k3_tok.encode(case["text"])  # the markers' spellings are control ids here
        p = XtmlParser.for_tokenizer(k3_tok, channel="think" if case["thinking"] else "response")
        events = [e for t in ids for e in p.feed_ids([t])] + p.finish()
        assert _calls(p) == ref["calls"], (i, case["text"])
        assert [[e.name, e.arguments] for e in events if isinstance(e, ToolCall)] == ref["calls"]
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == p.content
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == p.reasoning


def _message_back(p: XtmlParser) -> dict:
    calls = [{"name": c.name, "arguments": c.arguments} for c in p.tool_calls]
    calls += [{"name": q.id.split(".", 1)[1].rsplit(":", 1)[0], "arguments": q.arguments}
              for q in p.problems if q.kind == "invalid_arguments"]
    return {"reasoning_content": p.reasoning, "content": p.content, "tool_calls": calls}


def test_render_parse_render_is_stable(cases, k3_tok):
    rng = random.Random(SEED + 1)
    messages = [c["message"] for c in cases[:N_RANDOM]]
    # the raw-JSON block: arguments that are not JSON render as one block and come back as written
    messages += [{"reasoning_content": "", "content": "", "tool_calls": [
        {"name": "edit", "arguments": '{"path": "a.py", "text": "x'}]}]
    for message in messages:
        thinking = rng.random() < 0.5
        segments = generated(message, thinking)
        p = XtmlParser.for_tokenizer(k3_tok, channel="think" if thinking else "response")
        p.feed_ids(as_ids(segments, k3_tok))
        p.finish()
        back = _message_back(p)
        if thinking:
            assert back["reasoning_content"] == message["reasoning_content"]
        assert as_text(turn_segments(back, thinking)) == as_text(turn_segments(message, thinking))
        assert as_ids(turn_segments(back, thinking), k3_tok) == as_ids(turn_segments(message, thinking), k3_tok)
        for call, original in zip(back["tool_calls"], message["tool_calls"]):
            try:
                assert json.loads(call["arguments"]) == json.loads(original["arguments"])
            except ValueError:
                assert call["arguments"] == original["arguments"]


def test_json_block_is_the_arguments_text():
    p = XtmlParser(channel="response")
    p.feed_text('<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="a" index="1"<|sep|>'
                '<|open|>json type="object"<|sep|>{"k": [1, 2]}<|close|>json<|sep|><|close|>call<|sep|>'
                '<|open|>call tool="b" index="2"<|sep|><|open|>json type="object"<|sep|>{"k": <|close|>json<|sep|>'
                '<|close|>call<|sep|><|close|>tools<|sep|>')
    p.finish()
    assert [c.to_dict() for c in p.tool_calls] == [{"id": "functions.a:0", "name": "a", "arguments": '{"k": [1, 2]}'}]
    assert [(q.kind, q.index, q.arguments) for q in p.problems] == [("invalid_arguments", 1, '{"k": ')]


def test_attributes_are_unescaped_and_values_typed():
    p = XtmlParser(channel="response")
    p.feed_text('<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="a&amp;b&quot;" index="1"<|sep|>'
                '<|open|>argument key="k&quot;&amp;quot;" type="string"<|sep|>42<|close|>argument<|sep|>'
                '<|open|>argument key="n" type="number"<|sep|>42<|close|>argument<|sep|>'
                '<|open|>argument key="o" type="object"<|sep|>{"x": null}<|close|>argument<|sep|>'
                '<|close|>call<|sep|>')
    (call,) = p.tool_calls
    assert call.name == 'a&b"'
    assert json.loads(call.arguments) == {'k"&quot;': "42", "n": 42, "o": {"x": None}}


def test_control_spellings_as_text_stay_text(k3_tok):
    """A value holding "<|close|>argument<|sep|>" as bytes (how K3's renderer encodes a string
    with specials disallowed) is text to the id-level parser."""
    message = {"content": "see <|open|>tools<|sep|>", "tool_calls": [
        {"name": "w", "arguments": json.dumps({"s": "x<|close|>argument<|sep|>y<|end_of_msg|>"})}]}
    p = XtmlParser.for_tokenizer(k3_tok, channel="response")
    events = p.feed_ids(as_ids(generated(message, False), k3_tok)) + p.finish()
    assert p.content == "see <|open|>tools<|sep|>" and not p.problems
    assert json.loads(p.tool_calls[0].arguments) == {"s": "x<|close|>argument<|sep|>y<|end_of_msg|>"}
    assert [type(e) for e in events if not isinstance(e, ContentDelta)] == [ToolCall]


def test_each_call_arrives_with_its_close_tag():
    p = XtmlParser(channel="response")
    assert p.feed_text("Hi<|close|>response<|sep|><|open|>tools<|sep|>") == [ContentDelta("Hi")]
    assert p.feed_text('<|open|>call tool="ls" index="1"<|sep|><|open|>argument key="p" type="string"<|sep|>.') == []
    assert p.feed_text("<|close|>argument<|sep|><|close|>call") == []
    (call,) = p.feed_text("<|sep|>")
    assert call == ToolCall(0, "functions.ls:0", "ls", '{"p": "."}')
    assert p.feed_text('<|open|>call tool="cat" index="2"<|sep|>') == []
    (cut,) = p.finish()
    assert isinstance(cut, ToolCallProblem) and cut.kind == "incomplete" and cut.id == "functions.cat:1"


def test_the_prompt_says_where_the_output_starts(k3_tok):
    gen = [k3_tok.token_id("<|open|>"), *k3_tok.encode("message role=\"assistant\"", allow_special=False),
           k3_tok.token_id("<|sep|>"), k3_tok.token_id("<|open|>")]
    sep = k3_tok.token_id("<|sep|>")
    assert opened_channel(gen + k3_tok.encode("think", allow_special=False) + [sep], k3_tok) == "think"
    assert opened_channel(gen + k3_tok.encode("response", allow_special=False) + [sep], k3_tok) == "response"
    assert opened_channel(gen[:-1], k3_tok) == "top"
    p = XtmlParser.for_tokenizer(k3_tok, gen + k3_tok.encode("think", allow_special=False) + [sep])
    p.feed_text("plan<|close|>think<|sep|><|open|>response<|sep|>done<|close|>response<|sep|>")
    assert (p.reasoning, p.content) == ("plan", "done")


def test_bad_channel_is_refused():
    with pytest.raises(ValueError, match="channel must be 'top', 'think' or 'response', got 'thinking'"):
        XtmlParser(channel="thinking")


def test_between_channels_text_is_dropped_and_stray_tags_are_problems():
    p = XtmlParser(channel="response")
    p.feed_text('hi<|close|>response<|sep|>junk<|open|>message role="x"<|sep|><|close|>message<|sep|>')
    p.finish()
    assert p.content == "hi" and [q.kind for q in p.problems] == ["unexpected_marker"]
    top = XtmlParser()  # a prompt that opened no channel: text before the first one is content
    top.feed_text("plain<|open|>response<|sep|> answer<|close|>response<|sep|>")
    assert top.content == "plain answer"


if __name__ == "__main__":  # print the corpus, for a look
    json.dump(corpus(), sys.stdout, ensure_ascii=False, indent=1)
