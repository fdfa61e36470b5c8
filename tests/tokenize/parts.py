"""Realistic conversation parts and a literal reference of Moonshot's encode, for the tests."""

from hypothesis import strategies as st

SOURCE = '''def fib(n: int) -> int:\n    """Fibonacci."""\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n'''
CPP = "template <typename T>\nstatic inline T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }\r\n"
CJK = "你好，世界！这是一个测试。日本語のテキストも含む。한국어 문장도 있습니다."
EMOJI = "done ✅ 🚀🔥 family: 👨‍👩‍👧‍👦 flags 🇯🇵 skin 👋🏽"
JSON = '{"path": "src/main.rs", "lines": [1, 2, 3], "ok": true, "note": "naïve café"}'
SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|tool_call_begin|>",
            "<think>", "</think>", "[EOS]", "<|reserved_token_163700|>", "<|im_end"]
LOG = "2026-11-30T00:00:01Z INFO request id=af31 latency_ms=12.5\n" * 3
MINIFIED = "var a=function(){return 1};" * 1000  # one non-whitespace run > 25,000 chars
SPACES = " " * 25_003 + "x"

FRAGMENTS = [SOURCE, CPP, CJK, EMOJI, JSON, LOG, "", " ", "\n\n", "  indented\n", "CamelCase's they'll",
             "12345678", "e\u0301 vs é", *SPECIALS]
LONG_FRAGMENTS = [MINIFIED, SPACES]


def text(allow_long: bool = True):
    """Text made of 0..4 realistic fragments and short random strings (long runs included)."""
    frag = st.sampled_from(FRAGMENTS + (LONG_FRAGMENTS if allow_long else []))
    return st.lists(st.one_of(frag, frag, st.text(max_size=12)), max_size=4).map("".join)


def tool_call(idx: int, args):
    return {"id": f"functions.bash:{idx}", "type": "function",
            "function": {"name": "bash", "arguments": args}}


ARGS = st.one_of(st.just('{"cmd": "ls -la"}'), st.just("{}"),
                 st.dictionaries(st.sampled_from(["cmd", "path", "n", "中文"]),
                                 st.one_of(st.integers(), st.text(max_size=8)), max_size=3))


def literal_split(s: str, max_run: int):
    """Moonshot's _split_whitespaces_or_nonwhitespaces, transcribed as a per-character loop."""
    run, is_space, start = 0, (s[0].isspace() if s else False), 0
    for i, ch in enumerate(s):
        now = ch.isspace()
        if is_space ^ now:
            run, is_space = 1, now
        else:
            run += 1
            if run > max_run:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


def reference_encode(tok, s: str) -> list[int]:
    """Split on special strings, 400,000-char windows per segment, literal run split, encode each."""
    import re

    names = sorted(tok.special_tokens, key=len, reverse=True)
    ids, pos = [], 0
    for m in re.finditer("|".join(map(re.escape, names)), s):
        ids += _segment(tok, s[pos:m.start()])
        ids.append(tok.special_tokens[m.group()])
        pos = m.end()
    return ids + _segment(tok, s[pos:])


def _segment(tok, seg):
    out = []
    for i in range(0, len(seg), 400_000):
        for piece in literal_split(seg[i:i + 400_000], 25_000):
            out += tok._enc.encode(piece, allowed_special=set(), disallowed_special=())
    return out
