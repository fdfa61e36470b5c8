"""K3's tool results re-sorted into the calls' order, checked against vLLM 0.32's K3 renderer
(``vllm/renderers/kimi_k3.py``, run in vLLM's own interpreter: ``KVTIER_VLLM_PYTHON``, default
``.vllm-venv``): for random parallel calls answered in any order, partly, or with an id that
resolves to no call, kvtier renders the results in vLLM's order with vLLM's tool names (vLLM leaves
an unresolved run as sent and names no tool there; kvtier then names each by the call at its
position, as K3's renderer does, which vLLM leaves to it)."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from kvtier.tokenize.xtml import result_order

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("KVTIER_VLLM_PYTHON", str(ROOT / ".vllm-venv" / "bin" / "python"))
NORMALIZE = """
import json, sys
from vllm.renderers.kimi_k3 import _normalize_k3_tool_messages
for line in sys.stdin:
    print(json.dumps(_normalize_k3_tool_messages(json.loads(line))), flush=True)
"""
NAMES = ["bash", "read_file", "grep", "edit"]


def _conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": "user", "content": "go"}]
    for turn in range(rng.randint(1, 3)):
        n = rng.randint(1, 4)
        calls = [{"id": f"t{turn}c{k}", "type": "function",
                  "function": {"name": rng.choice(NAMES), "arguments": "{}"}} for k in range(n)]
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        answered = rng.sample([c["id"] for c in calls], rng.randint(1, n))  # a subset, in any order
        if rng.random() < 0.2:
            answered[rng.randrange(len(answered))] = "unknown-id"
        messages += [{"role": "tool", "tool_call_id": i, "content": f"result of {i}"} for i in answered]
        if rng.random() < 0.5:
            messages.append({"role": "user", "content": "next"})
    return messages


@pytest.fixture(scope="module")
def vllm_normalized():
    if not Path(PYTHON).is_file():
        pytest.skip(f"no vLLM interpreter at {PYTHON} (set KVTIER_VLLM_PYTHON, or run scripts/setup_vllm.sh)")
    rng = random.Random(63)
    conversations = [_conversation(rng) for _ in range(200)]
    proc = subprocess.run([PYTHON, "-c", NORMALIZE], input="".join(json.dumps(c) + "\n" for c in conversations),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "No module named 'vllm'" in proc.stderr:
        pytest.skip(f"vLLM is not installed in {PYTHON}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return list(zip(conversations, (json.loads(line) for line in proc.stdout.splitlines())))


def test_results_in_vllms_order_with_its_tool_names(vllm_normalized):
    resolved_runs = 0
    for messages, theirs in vllm_normalized:
        ours = result_order(messages)
        assert [messages[i] for i, _ in ours] == [{k: v for k, v in m.items() if k not in ("tool", "index")}
                                                   for m in theirs]
        for (i, name), m in zip(ours, theirs):
            if "tool" in m:  # vLLM resolved the whole run
                assert name == m["tool"]
                resolved_runs += 1
            elif messages[i]["role"] == "tool":  # unresolved: named by the call at its position
                assert name in NAMES
    assert resolved_runs > 100
