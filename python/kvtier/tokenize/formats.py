"""Which chat format a model speaks: Kimi K2's Jinja-template format or Kimi K3's XTML.

The format is a property of the model's files (its tokenizer configuration and model config),
never of a preset name. Renderers (``kvtier.tokenize``), output parsers and grammars
(``kvtier.toolcall``) branch on :class:`ChatFormat` and nothing else.

K3's control tokens (``../shared/docs/K3.md``, "K3's chat format"): K3's ``tokenizer_config.json``
puts them at ids 163584-163589 and 163838-163839, where K2 has ``[BOS]``, ``[EOS]``,
``<|im_end|>``, ``<|im_user|>``, ``<|im_assistant|>`` and ``<|start_header_id|>``.
"""

from __future__ import annotations

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
