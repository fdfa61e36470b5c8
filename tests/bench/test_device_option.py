"""``LLM(..., device=)`` and ``kvtier bench --device``: a clear error for a GPU this machine does
not have; on a GPU (tests marked ``gpu``) every bench configuration runs there."""

import json

import pytest
import torch

from kvtier import LLM
from kvtier.bench.run import BenchOptions
from kvtier.cli import main
from kvtier.llm import MAX_RANDOM_PRESET_BYTES
from kvtier.model.config import preset
from kvtier.model.weights import weights_bytes

NO_GPU = not torch.cuda.is_available()
ALL_CONFIGS = "device-only,tiered,tiered-write-through,tiered-tool-aware"


@pytest.mark.skipif(not NO_GPU, reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match=r"device='cuda' needs a CUDA or ROCm GPU"):
        LLM("tiny", device="cuda")
    with pytest.raises(ValueError, match=r"--device='cuda' needs a CUDA or ROCm GPU"):
        BenchOptions(device="cuda")
    assert main(["bench", "--device", "cuda", "--plot", ""]) == 2
    assert "--device='cuda' needs a CUDA or ROCm GPU" in capsys.readouterr().err


def test_bad_device_values_are_named():
    with pytest.raises(ValueError, match=r"--device='tpu' is not a torch device"):
        BenchOptions(device="tpu")
    with pytest.raises(ValueError, match="device must be a str or torch.device"):
        LLM("tiny", device=0)


def test_gpu_preset_keeps_k2_layers_and_fits_the_random_weight_limit():
    k2, gpu = preset("kimi-k2"), preset("k2-gpu")
    for name in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size", "intermediate_size",
                 "n_shared_experts", "first_k_dense_replace", "rope_scaling", "max_position_embeddings"):
        assert getattr(gpu, name) == getattr(k2, name), name
    assert gpu.kv_cache_bytes_per_token(2) * k2.num_hidden_layers == k2.kv_cache_bytes_per_token(2) * 4
    assert weights_bytes(gpu, 2) <= MAX_RANDOM_PRESET_BYTES
    assert gpu.max_position_embeddings >= 32768


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA or ROCm GPU")
def test_bench_runs_every_configuration_on_the_gpu(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--device", "cuda", "--sessions", "2", "--concurrency", "2", "--max-turns", "2",
               "--token-scale", "0.015625", "--configs", ALL_CONFIGS, "--json", str(out), "--plot", ""])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["configs"]) == set(ALL_CONFIGS.split(","))
    for cfg in data["configs"].values():
        assert cfg["requests"] == 4 and cfg["errors"] == 0
    assert data["provenance"]["options"]["device"] == "cuda"
