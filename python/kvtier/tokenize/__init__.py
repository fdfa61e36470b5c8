"""Kimi tokenization: the tiktoken tokenizer, the two chat formats and incremental session encoding.

- :func:`load_tokenizer` → :class:`KimiTokenizer` (``encode``/``decode``, ``chat_format``) and
  :class:`StreamDecoder`; :class:`ChatFormat`: the format the model's config and files choose.
- :func:`render_chat`: the K2 chat template (K2-0905 style; ``thinking=True`` for K2-Thinking).
- :mod:`kvtier.tokenize.xtml`: K3's XTML segments (:func:`~kvtier.tokenize.xtml.encode_xtml`).
- :class:`SessionEncoder`: per-session K2 ids, re-encoding only from the last special token before
  the first change (``mode="canonical"``), or keeping sampled ids (``mode="tito"``);
  :class:`XtmlSessionEncoder` the same for K3's parts; :func:`session_encoder` picks one by format.
"""

from kvtier.tokenize.chat import DEFAULT_SYSTEM, GENERATION_PROMPT, render_chat, render_messages
from kvtier.tokenize.formats import K3_CONTROL_TOKENS, ChatFormat, choose_chat_format, model_chat_format
from kvtier.tokenize.session import AppendResult, IdStore, ListIdStore, SessionEncoder
from kvtier.tokenize.tokenizer import KimiTokenizer, StreamDecoder, copy_tokenizer, has_tokenizer, load_tokenizer
from kvtier.tokenize.xtml_session import XtmlSessionEncoder, session_encoder

__all__ = ["AppendResult", "ChatFormat", "DEFAULT_SYSTEM", "GENERATION_PROMPT", "IdStore", "K3_CONTROL_TOKENS",
           "KimiTokenizer", "ListIdStore", "SessionEncoder", "StreamDecoder", "XtmlSessionEncoder",
           "choose_chat_format", "copy_tokenizer", "has_tokenizer", "load_tokenizer", "model_chat_format",
           "render_chat", "render_messages", "session_encoder"]
