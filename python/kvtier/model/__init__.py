"""Kimi K2 (DeepSeek-V3 architecture): config, paged-cache forward pass, weight formats and loading,
memory plan."""

from kvtier.model.batch import AttentionBatch
from kvtier.model.checkpoint import create_random_checkpoint, quantize_fp8_block
from kvtier.model.config import PRESETS, KimiK2Config, YarnScaling, preset
from kvtier.model.formats import PRESET_FORMATS, WeightFormats
from kvtier.model.kimi_k2 import KimiK2ForCausalLM
from kvtier.model.loader import dequantize_fp8_block, load_model, read_config
from kvtier.model.plan import MemoryPlan, memory_plan

__all__ = [
    "PRESETS", "PRESET_FORMATS", "AttentionBatch", "KimiK2Config", "KimiK2ForCausalLM", "MemoryPlan", "WeightFormats",
    "YarnScaling", "create_random_checkpoint", "dequantize_fp8_block", "load_model", "memory_plan", "preset",
    "quantize_fp8_block", "read_config",
]
