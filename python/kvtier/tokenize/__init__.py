"""Kimi K2 tokenization: the tiktoken tokenizer, the chat template and incremental session encoding.

- :func:`load_tokenizer` → :class:`KimiTokenizer` (``encode``/``decode``) and :class:`StreamDecoder`.
- :func:`render_chat`: the K2 chat template (K2-0905 style; ``thinking=True`` for K2-Thinking).
- :class:`SessionEncoder`: per-session ids, re-encoding only from the last special token before
  the first change (``mode="canonical"``), or keeping sampled ids (``mode="tito"``).
"""

from kvtier.tokenize.chat import DEFAULT_SYSTEM, GENERATION_PROMPT, render_chat, render_messages
from kvtier.tokenize.formats import K3_CONTROL_TOKENS, ChatFormat, choose_chat_format
from kvtier.tokenize.session import AppendResult, IdStore, ListIdStore, SessionEncoder
from kvtier.tokenize.tokenizer import KimiTokenizer, StreamDecoder, copy_tokenizer, has_tokenizer, load_tokenizer

__all__ = ["AppendResult", "ChatFormat", "K3_CONTROL_TOKENS", "choose_chat_format", "DEFAULT_SYSTEM", "GENERATION_PROMPT", "IdStore", "KimiTokenizer", "ListIdStore",
           "SessionEncoder", "StreamDecoder", "copy_tokenizer", "has_tokenizer", "load_tokenizer", "render_chat", "render_messages"]
