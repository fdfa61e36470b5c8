"""Hybrid models are refused when the connector is built: a Kimi Linear / Kimi K3 / Mamba-hybrid
KV cache config (an MLA group beside ``MambaSpec`` state groups), a model vLLM marks hybrid, or a
cache of states alone, on the scheduler and on the worker, with a message that names the model
type, says the connector moves MLA/attention blocks only (no recurrent-state checkpoints) and
points to ``kvtier serve``; a plain MLA model is still accepted.

vLLM lives in its own interpreter (``KVTIER_VLLM_PYTHON``, default ``.vllm-venv``, as in
``test_vllm_connector.py``): the connector is built there from vLLM's own ``KVCacheConfig``,
``KVCacheGroupSpec``, ``MLAAttentionSpec`` and ``MambaSpec`` objects, with the model config reduced
to the fields the connector reads (no weights, no hub). Skipped, saying why, when that interpreter
cannot import vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("KVTIER_VLLM_PYTHON", str(ROOT / ".vllm-venv" / "bin" / "python"))

# Run by vLLM's interpreter: builds the connector for each case and role, prints
# {case: {role: error message or null}} as JSON on its last line.
_PROBE = r'''
import json, sys
from types import SimpleNamespace
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, MambaSpec
from kvtier.integrations.vllm import KvtierConnector

BLOCK = 16
MLA = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
# a KDA layer's state: short-conv state and the recurrent state [heads, head_dim, head_dim]
KDA = MambaSpec(block_size=BLOCK, shapes=((3, 512), (4, 128, 128)), dtypes=(torch.bfloat16, torch.float32))

def cache(*specs):
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

def vllm_config(model_type, is_hybrid=False, text_type=None, extra=None):
    hf = SimpleNamespace(model_type=model_type)
    text = SimpleNamespace(model_type=text_type or model_type)
    return SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype=torch.bfloat16, hf_config=hf,
                                     hf_text_config=text, is_hybrid=is_hybrid),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {},
                                           kv_load_failure_policy="recompute"))

CASES = {
    # an unknown setting too: the model is refused before the settings are checked
    "kimi_linear": (vllm_config("kimi_linear", is_hybrid=True, extra={"host_cache_byte": 1}), cache(MLA, KDA, KDA)),
    "kimi_k3": (vllm_config("kimi_k3", text_type="kimi_linear"), cache(MLA, KDA)),
    "marked_hybrid": (vllm_config("jamba", is_hybrid=True), cache(MLA)),
    "states_only": (vllm_config("mamba"), cache(KDA)),
    "mla": (vllm_config("deepseek_v3"), cache(MLA)),
}
out = {}
for name, (cfg, kv) in CASES.items():
    out[name] = {}
    roles = ["WORKER"] if name == "mla" else ["SCHEDULER", "WORKER"]  # the scheduler of "mla" would probe
    for role in roles:
        try:
            c = KvtierConnector(cfg, KVConnectorRole[role], kv)
            out[name][role] = None
            out[name]["page_shape"] = list(c.layout.page_shape)
        except ValueError as e:
            out[name][role] = str(e)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def refusals() -> dict:
    if not Path(PYTHON).exists():
        pytest.skip(f"no vLLM interpreter at {PYTHON} (set KVTIER_VLLM_PYTHON, or run KVTIER_WITH_VLLM=1 "
                    "scripts/setup.sh to create .vllm-venv)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run([PYTHON, "-c", _PROBE], capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0 and "No module named 'vllm'" in r.stderr:
        pytest.skip(f"{PYTHON} cannot import vllm")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case, model_type, why", [
    ("kimi_linear", "kimi_linear", "kimi_linear is a hybrid KDA + MLA model"),
    ("kimi_k3", "kimi_k3", "kimi_k3 is a hybrid KDA + MLA model"),
    ("marked_hybrid", "jamba", "vLLM marks it hybrid"),
    ("states_only", "mamba", "per-sequence states (MambaSpec)"),
])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_a_hybrid_model_is_refused_at_start_saying_why(refusals, case, model_type, why, role):
    message = refusals[case][role]
    assert message is not None, f"{case} was accepted on the {role}"
    assert message.startswith(f"KvtierConnector cannot serve model type {model_type!r}: ")
    assert why in message
    assert "moves MLA/attention KV blocks only" in message
    assert "does not move the recurrent-state checkpoints" in message
    assert "`kvtier serve`" in message


def test_the_kimi_linear_message_lists_its_cache_groups(refusals):
    message = refusals["kimi_linear"]["WORKER"]
    assert "(MLAAttentionSpec, MambaSpec, MambaSpec)" in message
    assert "kv_connector_extra_config" not in message  # refused before the bad setting is looked at


def test_an_mla_model_is_still_accepted(refusals):
    assert refusals["mla"]["WORKER"] is None
    assert refusals["mla"]["page_shape"] == [16, 576]  # the MLA page: block_size tokens of 576 (one head)
