"""kvtier's tiers inside vLLM: the KV connector ``KvtierConnector`` (docs/vllm.md).

Use as ``--kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_connector_module_path":
"kvtier.integrations.vllm", "kv_role": "kv_both", ...}'``. Importing this package does not import
vLLM; reading ``KvtierConnector`` does (:mod:`.connector`). :mod:`.config` (the settings) and
:mod:`.tiers` (the scheduler's index and the worker's tiers) need no vLLM.
"""

__all__ = ["KvtierConnector"]


def __getattr__(name: str):
    if name == "KvtierConnector":
        from kvtier.integrations.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
