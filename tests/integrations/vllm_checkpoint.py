"""A tiny random standard-attention Llama checkpoint with a local word-level tokenizer (no hub).

Run by the vLLM interpreter as ``python vllm_checkpoint.py DIR [VOCAB [PRESET]]`` (it needs
``transformers`` and ``tokenizers``, which vLLM brings), or imported. ``PRESET`` is a name of
:data:`PRESETS`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 512
PRESETS = {
    # the tests' model: recomputes a 32-token block in well under a millisecond
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=1024),
    # the connector bench's model (perf/vllm_connector_bench.py): standard attention with GQA, about
    # 73M parameters outside the embeddings (~146 MFLOP a token: a few hundred ms to prefill a few
    # hundred tokens on 2 CPU cores), 12 KiB of fp32 KV per token (384 KiB per 32-token block)
    "standard": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                     num_key_value_heads=2, head_dim=64, max_position_embeddings=8192),
}


def write_checkpoint(out: Path, seed: int = 0, vocab_size: int = VOCAB, preset: str = "tiny") -> Path:
    """Write ``config.json``, ``model.safetensors`` and a tokenizer to ``out``: the model of
    ``PRESETS[preset]`` (``tiny``: 2 layers, hidden 64, 2 query heads and 2 KV heads of 32; vLLM's CPU
    attention needs head sizes of 32 or more), a ``vocab_size``-token vocabulary (ids 0-2 special,
    then words ``w3``, ``w4``, ...).

    Raises:
        ValueError: an unknown ``preset``.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, **PRESETS[preset],
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3 if preset == "tiny" else 0.05)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


if __name__ == "__main__":
    write_checkpoint(Path(sys.argv[1]), vocab_size=int(sys.argv[2]) if len(sys.argv) > 2 else VOCAB,
                     preset=sys.argv[3] if len(sys.argv) > 3 else "tiny")
