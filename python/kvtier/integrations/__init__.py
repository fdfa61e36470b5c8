"""kvtier's tiers inside other engines: :mod:`kvtier.integrations.vllm` (a vLLM v1 KV connector)."""
