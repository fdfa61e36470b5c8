"""The Kimi K2 tokenizer: tiktoken BPE over ``tiktoken.model`` with Moonshot's encode semantics.

Encode semantics (docs/kimi.md, "Tokenizer"): every special-token string in the text becomes its
control id; the text between special tokens ("segments") is cut into 400,000-character windows,
each window into pieces wherever a run of whitespace or of non-whitespace passes 25,000
characters, and each piece is BPE-encoded on its own. Windows are counted per segment.

Example:
    >>> tok = load_tokenizer("../shared/kimi_tokenizer")          # doctest: +SKIP
    >>> tok.encode("functions.bash:0")                              # doctest: +SKIP
    [41937, 1948, 1596, 25, 15]
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvtier.tokenize.formats import choose_chat_format

VOCAB_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
NUM_RESERVED_SPECIAL_TOKENS = 256
K3_NUM_BPE_RANKS = 163_584  # K3's control ids (163584+) sit right after K2's BPE ranks
WINDOW_CHARS = 400_000  # Moonshot's TIKTOKEN_MAX_ENCODE_CHARS
MAX_RUN_CHARS = 25_000  # Moonshot's MAX_NO_WHITESPACES_CHARS

PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Python's re ``\s`` on str is exactly ``str.isspace`` (both use Py_UNICODE_ISSPACE), the test
# Moonshot's splitter applies per character.
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))


def split_long_runs(window: str, max_run: int = MAX_RUN_CHARS) -> list[str]:
    """Cut ``window`` where a whitespace or non-whitespace run passes ``max_run`` characters.

    Same pieces as Moonshot's ``_split_whitespaces_or_nonwhitespaces``: inside a maximal run
    starting at ``a``, cuts fall at ``a + k * max_run`` (k ≥ 1). An empty window gives ``[""]``.
    """
    if len(window) <= max_run:
        return [window]
    pattern = _LONG_RUN if max_run == MAX_RUN_CHARS else re.compile(r"\s{%d,}|\S{%d,}" % (max_run + 1, max_run + 1))
    cuts = [cut for m in pattern.finditer(window) for cut in range(m.start() + max_run, m.end(), max_run)]
    if not cuts:
        return [window]
    bounds = [0, *cuts, len(window)]
    return [window[a:b] for a, b in zip(bounds, bounds[1:])]


class KimiTokenizer:
    """Kimi K2 BPE tokenizer (163,584 ranks + 256 special ids; n_vocab 163,840).

    Build it with :func:`load_tokenizer`. Ids are Python ints in ``[0, n_vocab)``.

    Attributes:
        special_tokens: ``{string: id}`` for all 256 special ids (named ones from
            ``tokenizer_config.json``; the rest ``<|reserved_token_{id}|>``).
        n_vocab: 163840 for the real vocabulary.
        chat_format: the :class:`kvtier.tokenize.formats.ChatFormat` the model speaks, chosen from
            the special tokens (:func:`kvtier.tokenize.formats.choose_chat_format`): K3's control
            tokens give ``K3_XTML``, K2's ``K2_TEMPLATE``.
    """

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int], name: str = "kimi"):
        import tiktoken

        self.special_tokens = dict(special_tokens)
        self.special_ids = {i: s for s, i in self.special_tokens.items()}
        self.chat_format = choose_chat_format(self.special_tokens)
        self._enc = tiktoken.Encoding(name=name, pat_str=PAT_STR, mergeable_ranks=mergeable_ranks,
                                      special_tokens=self.special_tokens)
        self.n_vocab = self._enc.n_vocab
        alternatives = sorted(self.special_tokens, key=len, reverse=True)  # longest first
        self._special_re = re.compile("|".join(re.escape(s) for s in alternatives))
        self._encode_ordinary = self._enc.encode_ordinary

    # -- ids of named tokens ------------------------------------------------------------------
    def token_id(self, token: str) -> int:
        """The id of special token ``token`` (e.g. ``"<|im_end|>"`` → 163586); KeyError if none."""
        return self.special_tokens[token]

    # -- encode ---------------------------------------------------------------------------------
    def encode_segment(self, text: str) -> list[int]:
        """Encode text that holds no special-token string (one segment), windows and runs applied."""
        if len(text) <= MAX_RUN_CHARS:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for start in range(0, len(text), WINDOW_CHARS):
            for piece in split_long_runs(text[start:start + WINDOW_CHARS]):
                ids.extend(self._encode_ordinary(piece))
        return ids

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Encode ``text`` with Moonshot's semantics.

        Args:
            text: any string.
            allow_special: True (Moonshot's behaviour): special-token strings in ``text`` become
                their control ids. False: they are encoded as ordinary text.

        Returns:
            list of ids.

        Raises:
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not allow_special:
            return self.encode_segment(text)
        ids, _ = self.encode_with_boundaries(text)
        return ids

    def encode_with_boundaries(self, text: str, char_offset: int = 0,
                               tok_offset: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
        """Encode ``text`` and return ``(ids, boundaries)``.

        ``boundaries`` lists ``(char_end, num_ids)`` right after each special token (offsets
        added): re-encoding ``text[char_end:]`` yields exactly ``ids[num_ids:]``, because
        special tokens split the text before BPE and windows restart at each segment.
        """
        ids: list[int] = []
        bounds: list[tuple[int, int]] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids.extend(self.encode_segment(text[pos:m.start()]))
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
            bounds.append((char_offset + pos, tok_offset + len(ids)))
        if pos < len(text):
            ids.extend(self.encode_segment(text[pos:]))
        return ids, bounds

    # -- decode ---------------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of ``ids`` (special ids give their strings). KeyError on an unknown id."""
        return self._enc.decode_bytes(list(ids))

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text; invalid UTF-8 becomes U+FFFD (``errors="replace"``)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns only complete UTF-8 characters.

    The concatenation of every ``push`` result plus ``finish()`` equals ``tokenizer.decode(ids)``.
    A multi-byte character split across ids is held back until its last byte arrives; bytes that
    can never form a character become U+FFFD exactly as in ``decode``.

    Example:
        >>> dec = StreamDecoder(tok)                                   # doctest: +SKIP
        >>> "".join(dec.push(i) for i in tok.encode("héllo 👋")) + dec.finish()  # doctest: +SKIP
        'héllo 👋'
    """

    def __init__(self, tokenizer: KimiTokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly ``""``)."""
        return self._utf8.decode(self._tok.decode_bytes([token_id]))

    def finish(self) -> str:
        """Flush: bytes still pending (an incomplete character) become U+FFFD."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


def _read_special_tokens(config_path: Path, num_base: int) -> dict[str, int]:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer config not found: {config_path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    decoder = config.get("added_tokens_decoder") if isinstance(config, dict) else None
    if not isinstance(decoder, dict):
        raise ValueError(f"{config_path}: expected an object 'added_tokens_decoder' mapping id -> token")
    lo, hi = num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS
    names = {i: f"<|reserved_token_{i}|>" for i in range(lo, hi)}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (isinstance(key, str) and key.isdigit()) or not isinstance(content, str) or not content:
            raise ValueError(f"{config_path}: added_tokens_decoder[{key!r}] needs a numeric id and a "
                             f"non-empty 'content' string, got {entry!r}")
        if not lo <= int(key) < hi:
            raise ValueError(f"{config_path}: added_tokens_decoder id {key} outside the special range "
                             f"[{lo}, {hi})")
        names[int(key)] = content
    specials = {s: i for i, s in names.items()}
    if len(specials) != len(names):
        raise ValueError(f"{config_path}: two special ids share one string")
    return specials


def load_tokenizer(model_dir: str | Path, chat_format=None) -> KimiTokenizer:
    """Load the Kimi tokenizer from ``model_dir`` (``tiktoken.model`` + ``tokenizer_config.json``).

    Args:
        model_dir: the directory of the two files.
        chat_format: the chat format of the model the tokenizer serves
            (:func:`kvtier.tokenize.formats.model_chat_format` of its ``config.json``), or None:
            the files' own (:func:`kvtier.tokenize.formats.choose_chat_format`). ``K3_XTML`` with
            K2's files gives K3's control tokens over the same BPE vocabulary (what
            :func:`copy_tokenizer` writes for a K3 checkpoint).

    Raises:
        FileNotFoundError: a file is missing (the message names its path).
        ValueError: a malformed vocabulary or config (named, with what was expected); a K3
            config for a model that speaks K2's template, or a vocabulary K3's control ids do
            not fit.
    """
    from tiktoken.load import load_tiktoken_bpe

    from kvtier.tokenize.formats import K3_CONTROL_TOKENS, ChatFormat, choose_chat_format

    if chat_format is not None and not isinstance(chat_format, ChatFormat):
        raise ValueError(f"chat_format must be a ChatFormat or None, got {chat_format!r}")
    model_dir = Path(model_dir)
    vocab_path = model_dir / VOCAB_FILE
    if not vocab_path.is_file():
        raise FileNotFoundError(f"Kimi vocabulary file not found: {vocab_path}")
    try:
        ranks = load_tiktoken_bpe(str(vocab_path))
    except Exception as e:  # tiktoken raises bare ValueError/binascii errors on bad lines
        raise ValueError(f"{vocab_path}: not a tiktoken vocabulary ('base64 rank' per line): {e}") from None
    if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{vocab_path}: ranks must be 0..n-1 without gaps")
    specials = _read_special_tokens(model_dir / CONFIG_FILE, len(ranks))
    own = choose_chat_format(specials)
    if chat_format is ChatFormat.K2_TEMPLATE and own is ChatFormat.K3_XTML:
        raise ValueError(f"{model_dir / CONFIG_FILE}: K3's control tokens, but the model speaks K2's chat template")
    if chat_format is ChatFormat.K3_XTML and own is ChatFormat.K2_TEMPLATE:
        if len(ranks) != K3_NUM_BPE_RANKS:
            raise ValueError(f"{vocab_path}: K3's control ids need {K3_NUM_BPE_RANKS} BPE ranks, got {len(ranks)}")
        names = {i: f"<|reserved_token_{i}|>" for i in range(len(ranks), len(ranks) + NUM_RESERVED_SPECIAL_TOKENS)}
        names.update({i: t for t, i in K3_CONTROL_TOKENS.items()})
        specials = {t: i for i, t in names.items()}
    return KimiTokenizer(ranks, specials, name=f"kimi:{vocab_path}")


def k3_tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` of Kimi K3 (``docs/k3.md``, "Chat format (XTML)").

    Its named special tokens are K3's control tokens at their ids
    (:data:`kvtier.tokenize.formats.K3_CONTROL_TOKENS`: ``[BOS]`` 163584 ... ``<|sep|>`` 163589,
    ``[UNK]`` 163838, ``[PAD]`` 163839); no chat template (K3 renders in code, not Jinja) and no
    token past the 163,840-id vocabulary (K3's ``tokenization_kimi.py`` still lists K2's
    ``<|im_end|>`` ... as additional special tokens, which would land at ids 163840+: left out).
    """
    from kvtier.tokenize.formats import K3_CONTROL_TOKENS

    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
               for t, i in sorted(K3_CONTROL_TOKENS.items(), key=lambda kv: kv[1])}
    return {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
            "unk_token": "[UNK]", "pad_token": "[PAD]", "additional_special_tokens": [],
            "clean_up_tokenization_spaces": False, "model_max_length": 1048576,
            "tokenizer_class": "TikTokenTokenizer"}


def copy_tokenizer(src_dir: str | Path, dst_dir: str | Path, chat_format=None) -> Path:
    """Copy the Kimi tokenizer files (``tiktoken.model``, ``tokenizer_config.json``) of
    ``src_dir`` into ``dst_dir`` (a checkpoint directory, as released checkpoints carry them),
    after checking that they load.

    Args:
        chat_format: None: copy both files as they are. ``ChatFormat.K3_XTML``: copy the BPE
            vocabulary and write K3's :func:`k3_tokenizer_config` (K3 shares K2's 163,584 BPE
            ranks, not its control tokens), so the checkpoint speaks K3's format.
            ``ChatFormat.K2_TEMPLATE``: copy both, and refuse a source whose config is K3's.

    Returns:
        ``dst_dir``.

    Raises:
        FileNotFoundError / ValueError: as :func:`load_tokenizer` for ``src_dir``; ValueError for
            an unknown ``chat_format``, a K3 vocabulary whose rank count is not 163,584, or a K3
            source asked to be K2's.
    """
    import shutil

    from kvtier.tokenize.formats import ChatFormat

    if chat_format is not None and not isinstance(chat_format, ChatFormat):
        raise ValueError(f"chat_format must be a ChatFormat or None, got {chat_format!r}")
    tok = load_tokenizer(src_dir)
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if chat_format is ChatFormat.K2_TEMPLATE and tok.chat_format is not ChatFormat.K2_TEMPLATE:
        raise ValueError(f"{src_dir / CONFIG_FILE}: a K3 tokenizer config, but the model speaks K2's chat format")
    base = tok.n_vocab - NUM_RESERVED_SPECIAL_TOKENS
    if chat_format is ChatFormat.K3_XTML and base != K3_NUM_BPE_RANKS:
        raise ValueError(f"{src_dir / VOCAB_FILE}: K3's control ids need {K3_NUM_BPE_RANKS} BPE ranks, got {base}")
    dst_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src_dir / VOCAB_FILE, dst_dir / VOCAB_FILE)
    if chat_format is ChatFormat.K3_XTML:
        (dst_dir / CONFIG_FILE).write_text(json.dumps(k3_tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    else:
        shutil.copyfile(src_dir / CONFIG_FILE, dst_dir / CONFIG_FILE)
    return dst_dir


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds the Kimi tokenizer's vocabulary file (``tiktoken.model``)."""
    return (Path(model_dir) / VOCAB_FILE).is_file()
