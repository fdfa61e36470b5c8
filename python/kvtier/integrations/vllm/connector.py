"""``KvtierConnector``: kvtier's host, disk and remote tiers behind vLLM v1's KV connector interface.

Start vLLM with::

    python -m vllm.entrypoints.openai.api_server --model DIR --enable-prompt-tokens-details \\
      --kv-transfer-config '{"kv_connector": "KvtierConnector",
                             "kv_connector_module_path": "kvtier.integrations.vllm",
                             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                             "kv_connector_extra_config": {"host_cache_bytes": 4000000000,
                                                           "disk_cache_dir": "/var/cache/kvtier",
                                                           "disk_cache_bytes": 100000000000}}'

What each side does (the tiers are ``cache/``'s, :mod:`kvtier.cache.tiers.foreign`;
:mod:`kvtier.integrations.vllm.tiers` runs them on vLLM's two sides):

* Scheduler. :meth:`KvtierConnector.get_num_new_matched_tokens` hashes the prompt's full blocks
  with kvtier's block hash (salted with the model, its dtype and the ``salt`` setting), finds the
  run after vLLM's own prefix-cache hit that kvtier's host, disk or remote tier holds, and asks the
  cost model how many of those blocks to load: 0 when recomputing them is faster. The prefill
  rate it compares with is learned from vLLM's own steps (:mod:`kvtier.integrations.vllm.rate`;
  a probe gives the first figure). Loads run layer by layer in the step that needs them
  (``load_mode: layer``, the default) or, with ``load_mode: async``, as vLLM's asynchronous loads
  (the request waits in ``WAITING_FOR_REMOTE_KVS`` while other requests run and is scheduled once
  a worker reports its load, :meth:`get_finished`). :meth:`build_connector_meta` plans each
  step's loads and the saves of every block that becomes full in it (prompt and output tokens).
* Worker. :meth:`register_kv_caches` opens the tiers over vLLM's per-layer caches;
  :meth:`start_load_kv` queues the planned loads on a loader thread (layer by layer:
  :meth:`wait_for_layer_load` holds a layer's attention until its blocks are in); :meth:`wait_for_save`
  queues the step's new full blocks for a saver thread (one gather per layer into host slots,
  then disk and the remote store, as ``write_policy`` says) and returns at once; the next step's
  :meth:`bind_connector_metadata` waits only for the gathers, before the forward pass may
  overwrite a freed block. A block that fails to load is returned by
  :meth:`get_block_ids_with_load_errors`, and vLLM recomputes it (with
  ``kv_load_failure_policy: recompute``; vLLM's default ``fail`` fails the request instead).

Hybrid models (Kimi Linear, Kimi K3, Mamba hybrids) are refused at start
(:func:`check_attention_only`): the connector moves attention and MLA blocks only, not the
recurrent states of linear-attention layers (docs/vllm.md, "Hybrid models").

Session hints: a request's ``kv_transfer_params`` may carry ``session_id`` (any JSON scalar) and
``expected_tool_wait_s`` (seconds, >= 0). When such a request finishes, its blocks are marked as
waiting on a tool; under ``cache_policy: tool-aware`` the host tier does not evict them for
``min(0.5 * expected_tool_wait_s, 30)`` seconds (:class:`kvtier.cache.eviction.ToolAwarePolicy`). The
session's next request ends the wait. With the OpenAI API, send
``{"kv_transfer_params": {"session_id": "s1", "expected_tool_wait_s": 4.0}, ...}`` in the body.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.cache.block_hash import block_hashes, compose_salt
from kvtier.cache.block_layout import BlockLayout
from kvtier.cache.tiers.foreign import TIER_NAMES
from kvtier.integrations.vllm.config import PREFIX, ConnectorConfig, open_remote_checked
from kvtier.integrations.vllm.rate import PrefillRate, probe_prefill_tok_s
from kvtier.integrations.vllm.tiers import LoadJob, SchedulerIndex, StepPlan, WorkerTiers
from kvtier.options import check_hashable, check_real

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.integrations.vllm")

_HIT_SOURCE = {tier: {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}.get(
    name, CacheHitSource.EXTERNAL_UNSPECIFIED) for tier, name in TIER_NAMES.items()}


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler's connector to the workers'."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class _Req:
    """What the scheduler's connector tracks of a running request."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    saved: int = 0  # leading blocks planned for saving (or found in the tiers)


HYBRID_MODEL_TYPES = ("kimi_linear", "kimi_k3")  # model_type of hybrid KDA + MLA configs, known without vLLM


def model_type(vllm_config: VllmConfig) -> str:
    """The ``model_type`` of vLLM's Hugging Face config (``kimi_linear``, ``deepseek_v3``, ...), or
    ``"unknown"`` if it has none."""
    hf_config = getattr(vllm_config.model_config, "hf_config", None)
    return str(getattr(hf_config, "model_type", None) or "unknown")


def _hybrid_marks(vllm_config: VllmConfig) -> list[str]:
    """Why the model config says hybrid: its ``model_type`` (or its text config's, for multimodal
    wrappers) is one of :data:`HYBRID_MODEL_TYPES`, or vLLM marks it (``ModelConfig.is_hybrid``: an
    ``IsHybrid`` model class with non-attention layers). Empty if neither."""
    mc = vllm_config.model_config
    types = {getattr(getattr(mc, name, None), "model_type", None) for name in ("hf_config", "hf_text_config")}
    marks = []
    known = sorted(types & set(HYBRID_MODEL_TYPES))
    if known:
        marks.append(f"{known[0]} is a hybrid KDA + MLA model")
    try:
        if getattr(mc, "is_hybrid", False) is True:
            marks.append("vLLM marks it hybrid")
    except (AttributeError, RuntimeError, ValueError):  # a model class the registry cannot resolve
        pass
    return marks


def check_attention_only(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Refuse a hybrid model: its ``model_type`` is one of :data:`HYBRID_MODEL_TYPES`, vLLM marks
    it hybrid, or a group of its KV cache has a spec without KV heads (``MambaSpec``: the recurrent
    and convolution states of Mamba, GDN or KDA layers, with their prefill checkpoints). Called
    first in the connector's construction, on the scheduler and on every worker, before any
    setting is checked or tier opened. (A cache of several attention groups is refused next, by
    :func:`page_layout`.)

    Raises:
        ValueError: a hybrid model; the message names its ``model_type`` and what marks it hybrid,
            says that the connector moves MLA/attention KV blocks only and no recurrent-state
            checkpoints, and points to ``kvtier serve``.
    """
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    specs = [type(g.kv_cache_spec).__name__ for g in groups]
    reasons = _hybrid_marks(vllm_config)
    if any(not hasattr(g.kv_cache_spec, "num_kv_heads") for g in groups):
        reasons.append(f"its KV cache groups hold per-sequence states ({', '.join(specs)})")
    if reasons:
        raise ValueError(
            f"KvtierConnector cannot serve model type {model_type(vllm_config)!r}: {'; '.join(reasons)}. "
            "kvtier's vLLM connector moves MLA/attention KV blocks only; it does not move the "
            "recurrent-state checkpoints of linear-attention (KDA, GDN, Mamba) layers, so a prefix it "
            "loaded would miss their state. Serve hybrid models (Kimi Linear, Kimi K3) with "
            "`kvtier serve` instead (its tiered pool keeps the state checkpoints, docs/k3.md), or start vLLM without "
            "--kv-transfer-config (docs/vllm.md, 'Hybrid models').")


def page_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> BlockLayout:
    """The tier block layout of vLLM's KV cache: every layer's logical page ``[num_kv_heads,
    block_size, head_size + head_size_v]`` (vLLM's per-layer view ``[num_blocks, H, N, C]``; K and V
    side by side in C for standard attention, C = 576 and H = 1 for MLA).

    Raises:
        ValueError: a cache of more than one group or a spec without heads (hybrid, Mamba; the
            connector refuses those earlier, :func:`check_attention_only`).
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"{PREFIX}: the kvtier connector handles one KV cache group, this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if not hasattr(spec, "num_kv_heads"):
        raise ValueError(f"{PREFIX}: the kvtier connector needs an attention KV cache, got {type(spec).__name__}")
    channels = spec.head_size + (spec.head_size_v or 0)
    return BlockLayout(len(groups[0].layer_names), (spec.num_kv_heads, spec.block_size, channels), 1, spec.dtype)


def model_salt(vllm_config: VllmConfig, salt: bytes) -> bytes:
    """The block-hash salt: the model (path or name, revision), the KV dtype and the tenant salt."""
    mc = vllm_config.model_config
    return compose_salt(str(mc.model).encode(), str(mc.revision or "").encode(), str(mc.dtype).encode(),
                        str(vllm_config.cache_config.cache_dtype).encode(), salt)


class KvtierConnector(KVConnectorBase_V1):
    """kvtier's tiers as a vLLM v1 KV connector (see the module docstring).

    Args:
        vllm_config: vLLM's config; ``kv_transfer_config.kv_connector_extra_config`` holds the
            settings of :mod:`kvtier.integrations.vllm.config`.
        role: scheduler or worker.
        kv_cache_config: vLLM's KV cache layout (groups, specs, number of blocks).

    Raises:
        ValueError: a bad setting (naming ``kv_connector_extra_config['KEY']``: an unknown key, a
            wrong type or range, an unwritable ``disk_cache_dir``, a ``remote_cache_url`` that does
            not answer), a model whose KV cache the connector does not handle: a hybrid model
            (Kimi Linear, Kimi K3, Mamba hybrids; :func:`check_attention_only`), refused before
            the settings are checked.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config, role, kv_cache_config)
        check_attention_only(vllm_config, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.block_size = vllm_config.cache_config.block_size
        self.config = ConnectorConfig.from_extra_config(dict(extra or {}), self.block_size)
        self.pool = self.config.pool
        self.salt = model_salt(vllm_config, self.pool.salt)
        self.pool = replace(self.pool, salt=self.salt)
        if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("kv_load_failure_policy is %r: a kvtier block that fails to load fails its request; "
                           "set it to 'recompute' to recompute such blocks",
                           vllm_config.kv_transfer_config.kv_load_failure_policy)
        self.layout = page_layout(vllm_config, kv_cache_config)
        self._worker: WorkerTiers | None = None
        self._index: SchedulerIndex | None = None
        if role == KVConnectorRole.SCHEDULER:
            remote = None
            if self.pool.remote_cache_url:
                remote = open_remote_checked(self.pool.remote_cache_url, self.layout.meta(), self.pool.remote_timeout_s)
            configured = self.config.prefill_tok_s
            start = configured if configured is not None else probe_prefill_tok_s(
                vllm_config.model_config.hf_text_config, _probe_dtype(vllm_config))
            self.rate = PrefillRate(start, learn=configured is None)
            self._index = SchedulerIndex(self.pool, self.layout, start, remote)
            self._reqs: dict[str, _Req] = {}
            self._planned: dict[str, tuple[int, list[bytes], list[int]]] = {}  # req_id -> (first block, hashes, tiers)
            self._loads: list[LoadJob] = []
            self._inflight: dict[str, list[LoadJob]] = {}  # async loads planned, not reported finished
            self._step_loads: list[LoadJob] = []  # layer-by-layer loads of the step in flight
            self._load_hash: dict[int, bytes] = {}  # vLLM block id -> hash, of loads not confirmed yet
            self._sessions: dict[str, Any] = {}  # req_id -> session_id
            logger.info("kvtier connector (scheduler): %d host slots of %d bytes, disk %s, remote %s, prefill "
                        "rate %.0f tokens/s (%s)", self._index.num_host_slots, self.layout.block_bytes,
                        self._index.disk_dir, self.pool.remote_cache_url, start,
                        "probed, then learned" if configured is None else "configured")

    # ==== scheduler side ============================================================================
    def _hashes(self, st: _Req, num_blocks: int) -> list[bytes]:
        """The first ``num_blocks`` block hashes of the request's tokens (prompt and output)."""
        if len(st.hashes) < num_blocks:
            tokens = list(st.request.all_token_ids[len(st.hashes) * self.block_size:num_blocks * self.block_size])
            parent = st.hashes[-1] if st.hashes else None
            st.hashes.extend(block_hashes(tokens, self.block_size, parent, self.salt))
        return st.hashes[:num_blocks]

    def _state(self, request: Request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _Req(request)
        return st

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   *args, **kwargs) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` to load from kvtier's tiers (whole blocks of the
        prompt, leaving its last token to compute), as the cost model chooses at the prefill rate
        learned so far; with ``load_mode: async`` loaded asynchronously (True)."""
        st = self._state(request)
        self._session_returns(request)
        limit = (request.num_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        if limit <= first or num_computed_tokens % self.block_size:
            return 0, False
        hashes = self._hashes(st, limit)[first:]
        self._index.cost_model.prefill_tok_s = self.rate.rate(num_computed_tokens, len(hashes) * self.block_size)
        k, tiers = self._index.blocks_to_load(hashes)
        max_new = kwargs.get("max_num_new_tokens")
        if max_new is not None:
            k = min(k, max_new // self.block_size)
        if k == 0:
            self._planned.pop(request.request_id, None)
            return 0, False
        self._planned[request.request_id] = (first, hashes[:k], tiers[:k])
        return k * self.block_size, self.config.load_mode == "async"

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict:
        """The loaded tokens by tier (host, disk; the remote store counts as unspecified)."""
        planned = self._planned.get(request.request_id)
        if not num_external_tokens or planned is None:
            return {}
        out: dict = {}
        for t in planned[2][:num_external_tokens // self.block_size]:
            out[_HIT_SOURCE[t]] = out.get(_HIT_SOURCE[t], 0) + self.block_size
        return out

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of the blocks :meth:`get_num_new_matched_tokens` offered into the blocks
        vLLM allocated for them."""
        st = self._state(request)
        block_ids = list(blocks.get_block_ids()[0])
        if len(block_ids) > len(st.block_ids):
            st.block_ids = block_ids
        planned = self._planned.pop(request.request_id, None)
        if num_external_tokens <= 0 or planned is None:
            return
        first, hashes, _ = planned
        n = num_external_tokens // self.block_size
        job = self._index.plan_load(request.request_id, block_ids[first:first + n], hashes[:n])
        self._loads.append(job)
        if self.config.load_mode == "async":
            self._inflight.setdefault(request.request_id, []).append(job)
        self._load_hash.update(zip(job.block_ids, job.hashes))
        st.saved = max(st.saved, first + n)  # loaded blocks are in the tiers already

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        """This step's loads and the saves of the blocks it fills; the step's work is timed
        (:class:`kvtier.integrations.vllm.rate.PrefillRate`) until its output comes back."""
        plan = StepPlan(loads=self._loads)
        if self.config.load_mode != "async":
            self._step_loads += self._loads
        self._loads = []
        self._time_step(scheduler_output)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                st.block_ids = list(new_ids[0])
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, done in computed.items():
            st = self._reqs[req_id]
            full = min((done + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // self.block_size,
                       len(st.block_ids))
            if full > st.saved:
                hashes = self._hashes(st, full)
                job = self._index.plan_save(st.block_ids[st.saved:full], hashes[st.saved:full])
                if job is not None:
                    plan.saves.append(job)
                st.saved = full
        self._index.take_pending(plan)
        return KvtierMetadata(plan)

    def _time_step(self, scheduler_output: SchedulerOutput) -> None:
        """Start timing the step: its prefill chunks ``(new, cached)`` and decodes."""
        extends, decodes, context = [], 0, 0
        sched = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        rows = [(new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs]
        rows += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, done in rows:
            n = sched.get(req_id, 0)
            if n == 1 and req_id in cached.req_ids:
                decodes, context = decodes + 1, context + done + 1
            elif n > 0:
                extends.append((n, done))
        self.rate.step_started(extends, decodes, context)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The step ended: fold its time into the prefill rate; unlock the host copies of loads
        that finished; forget the blocks whose load failed (they are recomputed, and not in the
        tiers)."""
        self.rate.step_ended()
        bad = [self._load_hash[b] for b in connector_output.invalid_block_ids if b in self._load_hash]
        if bad:
            self._index.drop(bad)
            logger.warning("kvtier: %d blocks failed to load and are recomputed", len(bad))
        done = [job for req_id in connector_output.finished_recving or () for job in self._inflight.pop(req_id, [])]
        done += self._step_loads  # layer-by-layer loads end within their step
        self._step_loads = []
        for job in done:
            self._index.loaded(job)
            for b in job.block_ids:
                self._load_hash.pop(b, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Start the session's tool wait if the request carried one; blocks are freed at once (a
        request that finishes while its load is in flight keeps its blocks in vLLM until the load
        is reported, as vLLM does for every asynchronous load)."""
        st = self._reqs.pop(request.request_id, None)
        self._sessions.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        hint = _session_hint(request)
        if hint is not None and st is not None:
            session_id, wait_s = hint
            self._index.policy.tool_wait(session_id, list(st.hashes[:st.saved]), wait_s, time.monotonic())
        return False, None

    def _session_returns(self, request: Request) -> None:
        hint = _session_hint(request, need_wait=False)
        if hint is not None and self._sessions.get(request.request_id) is None:
            self._sessions[request.request_id] = hint[0]
            self._index.policy.tool_return(hint[0])

    # ==== worker side ===============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Open the tiers over vLLM's per-layer caches ``[num_blocks, H, block_size, C]``.

        Raises:
            ValueError: caches whose page is not the one the scheduler's connector expects.
        """
        caches = list(kv_caches.values())
        found = BlockLayout.of_caches(caches, block_dim=0, token_dim=1)
        if found != self.layout or caches[0].shape[0] != self._kv_cache_config.num_blocks:
            raise ValueError(f"{PREFIX}: vLLM's KV caches are {tuple(caches[0].shape)} per layer ({found}); the "
                             f"kvtier connector expects [num_blocks={self._kv_cache_config.num_blocks}, "
                             f"*{self.layout.page_shape}] ({self.layout})")
        self._worker = WorkerTiers(self.pool, caches, 0, 1, stats_path=self._stats_path())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._failed: set[int] = set()
        logger.info("kvtier connector (worker): %d layers, %d-byte blocks, %d host slots", len(caches),
                    found.block_bytes, self._worker.host.capacity_blocks())

    def _stats_path(self) -> str | None:
        return (self._kv_transfer_config.kv_connector_extra_config or {}).get("stats_path")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's plan; first wait until the saves queued so far have copied their blocks
        out of vLLM's caches (this step's forward pass may overwrite a block vLLM freed)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.fence()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Queue this step's planned loads on the loader thread: layer by layer (vLLM calls this
        before the forward pass), or as asynchronous loads (after it)."""
        meta = self._get_connector_metadata()
        if not meta.plan.loads:
            return
        if self.config.load_mode == "async":
            for job in meta.plan.loads:
                self._worker.submit_load(job)
        else:
            self._worker.start_layered(meta.plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Hold this layer's attention until the step's loads put its blocks in (layer by layer;
        nothing to wait for with asynchronous loads)."""
        self._worker.wait_layer(self._layer_index.get(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Nothing per layer: :meth:`wait_for_save` queues whole blocks (all layers) after the pass."""

    def wait_for_save(self) -> None:
        """End the step's layer-by-layer loads (collecting their failures), then queue the step's
        spills, saves and disk removals; returns without waiting for those."""
        self._failed |= self._worker.end_layered()
        if self.has_connector_metadata():
            self._worker.submit_save(self._get_connector_metadata().plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(None, received)``: nothing is sent later (saves never hold vLLM's blocks); the
        requests whose loads all ended since the last call."""
        received, failed = self._worker.finished_loads()
        self._failed |= failed
        return None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of loads reported finished so far that failed (vLLM recomputes them)."""
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._index is not None:
            self._index.close()


def _probe_dtype(vllm_config) -> torch.dtype:
    dtype = vllm_config.model_config.dtype
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _session_hint(request, need_wait: bool = True) -> tuple[Any, float] | None:
    """``(session_id, expected_tool_wait_s)`` from the request's ``kv_transfer_params``; None if it
    has no session (or, with ``need_wait``, no wait).

    Raises:
        ValueError: a ``session_id`` that is not hashable, or a wait that is not a number >= 0.
    """
    params = getattr(request, "kv_transfer_params", None) or {}
    if "session_id" not in params:
        return None
    session_id = check_hashable("kv_transfer_params['session_id']", params["session_id"])
    if "expected_tool_wait_s" not in params:
        return None if need_wait else (session_id, 0.0)
    return session_id, float(check_real("kv_transfer_params['expected_tool_wait_s']",
                                        params["expected_tool_wait_s"], min_value=0.0))

