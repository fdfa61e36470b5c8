"""Which chat format a model speaks: Kimi K2's Jinja-template format or Kimi K3's XTML.

The format is a property of the model's files (its tokenizer configuration and model config),
never of a preset name. Renderers (``kvtier.tokenize``), output parsers and grammars
(``kvtier.toolcall``) branch on :class:`ChatFormat` and nothing else.

K3's control tokens (``docs/k3.md``, "Chat format (XTML)"): K3's ``tokenizer_config.json``
puts them at ids 163584-163589 and 163838-163839, where K2 has ``[BOS]``, ``[EOS]``,
``<|im_end|>``, ``<|im_user|>``, ``<|im_assistant|>`` and ``<|start_header_id|>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum


class ChatFormat(str, Enum):
    """The chat encoding a model was trained on."""

    K2_TEMPLATE = "k2-template"  # K2's chat template: <|im_user|>...<|im_end|>, JSON tool calls
    K3_XTML = "k3-xtml"  # K3's XTML segments: <|open|>message ...<|sep|>...<|close|>message<|sep|>


# K3's control tokens and their ids (K3's tokenizer_config.json; vocab 163,840).
K3_CONTROL_TOKENS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|end_of_msg|>": 163586,
    "<|open|>": 163587,
    "<|close|>": 163588,
    "<|sep|>": 163589,
    "[UNK]": 163838,
    "[PAD]": 163839,
}

# The tokens that make a message in K3's format; a tokenizer with all four at K3's ids speaks XTML.
_K3_MESSAGE_TOKENS = ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")


def choose_chat_format(special_tokens: Mapping[str, int]) -> ChatFormat:
    """The chat format of a model, read from its tokenizer's special tokens.

    K3's checkpoint has no chat template; its ``tokenizer_config.json`` names ``<|end_of_msg|>``,
    ``<|open|>``, ``<|close|>`` and ``<|sep|>`` at ids 163586-163589, the ids K2's names
    ``<|im_end|>``, ``<|im_user|>``, ``<|im_assistant|>`` and 163589 (unnamed). So the tokenizer files a
    model ships with decide the format, whatever the model is called.

    Args:
        special_tokens: ``{string: id}`` of the tokenizer's special tokens
            (:attr:`kvtier.tokenize.KimiTokenizer.special_tokens`).

    Returns:
        :attr:`ChatFormat.K3_XTML` when all four message tokens are at K3's ids, else
        :attr:`ChatFormat.K2_TEMPLATE`.

    Raises:
        ValueError: some of K3's message tokens are present but not all, or at other ids than K3's
            (a tokenizer config that is neither K2's nor K3's), naming the tokens.
    """
    present = {t: special_tokens[t] for t in _K3_MESSAGE_TOKENS if t in special_tokens}
    if not present:
        return ChatFormat.K2_TEMPLATE
    expected = {t: K3_CONTROL_TOKENS[t] for t in _K3_MESSAGE_TOKENS}
    if present != expected:
        raise ValueError(f"special_tokens: K3's message tokens must all be at K3's ids {expected}, got {present} "
                         "(a tokenizer_config.json that is neither K2's nor K3's)")
    return ChatFormat.K3_XTML


def model_chat_format(model_type: str) -> ChatFormat:
    """The chat format a model's ``config.json`` says it was trained on, from its ``model_type``
    (the outer one of a multimodal config): ``kimi_k3`` speaks XTML, every other Kimi model
    (``deepseek_v3`` K2, ``kimi_k2``, ``kimi_linear``) K2's template. Used where the tokenizer
    files are written for a model (``kvtier create-checkpoint --tokenizer``); a served model's
    format is its tokenizer's (:func:`choose_chat_format`).

    Raises:
        ValueError: ``model_type`` is not a string.
    """
    if not isinstance(model_type, str):
        raise ValueError(f"model_type must be a string, got {type(model_type).__name__}")
    return ChatFormat.K3_XTML if model_type == "kimi_k3" else ChatFormat.K2_TEMPLATE
