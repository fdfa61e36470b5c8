"""Offline API: ``LLM(model_dir_or_preset, **engine_args).generate(...)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import torch

from kvtier.options import check_choice, check_hashable, check_int, check_path
from kvtier.serve import RequestOutput, SamplingParams
from kvtier.serve.builder import (_DTYPES, MAX_RANDOM_PRESET_BYTES, _random_model, build_engine,  # noqa: F401
                                  check_device, load_for_serving)

def _check_llm_args(model, dtype, device, seed, tokenizer) -> None:
    """Types of :class:`LLM`'s own arguments (the engine's are :class:`EngineConfig`'s)."""
    check_path("model", model, optional=False)
    check_choice("dtype", dtype, ("auto", *_DTYPES))
    check_device("device", device)
    check_int("seed", seed, min_value=0, max_value=2**63 - 1)
    check_path("tokenizer", tokenizer)



class LLM:
    """A model with its engine, for offline generation.

    Args:
        model: a Hugging Face-layout weights directory (config.json + safetensors) or a preset
            name (``tiny``: deterministic random weights from ``seed``).
        dtype: ``auto`` (fp32 on CPU, bf16 on GPU), ``float32``, ``bfloat16`` or ``float16``: the
            compute dtype and that of the dense weights.
        dequantize: hold FP8 / INT4 weights dequantized in ``dtype`` (default: as
            stored, run by the quantized kernels; :mod:`kvtier.model.loader`).
        device: torch device for weights and KV cache: ``cpu`` or ``cuda`` (also on ROCm). On a
            GPU, host and disk tiers use the device copy path (pinned host tier, copy stream;
            :mod:`kvtier.cache.device_copy`).
        seed: seed of the random preset weights and of the engine's sampler.
        **engine_args: fields of :class:`kvtier.cache.config.PoolConfig` (page_size,
            num_device_pages, enable_prefix_caching, host_cache_bytes, disk_cache_dir,
            disk_cache_bytes, cache_policy, write_policy, salt, copy_threads, remote_cache_url,
            remote_timeout_s) and of :class:`kvtier.serve.EngineConfig` (max_num_batched_tokens,
            max_num_batched_pairs, max_num_seqs, cuda_graph, schedule_policy, schedule_max_passes), flat
            (:meth:`kvtier.serve.EngineConfig.of`).
            Cached blocks are keyed by token ids salted with the weights' fingerprint, the
            compute dtype and ``salt`` (bytes, the tenant's); on disk each salt and block layout has its own
            subdirectory of ``disk_cache_dir`` with its own ``disk_cache_bytes`` budget, so
            engines of other models, dtypes, page sizes or salts can share the directory and
            never see each other's blocks (engines with the same settings should not run on one
            directory at the same time: there is no cross-process locking).

    Every argument is checked for its type and range before the model is loaded (a bool is not
    an int, a str is not a size, an int is not a path or a salt); host and disk budgets that
    hold no block are errors once the model's block size is known.

    Raises:
        ValueError: an argument of the wrong type or out of range, an unknown preset or engine
        argument, naming it; FileNotFoundError for a directory without config.json; the
        loader's errors for bad weights.

    Example:
        >>> llm = LLM("tiny", num_device_pages=64)
        >>> out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4))
        >>> len(out[0].token_ids)
        4
    """

    def __init__(self, model: str | Path, *, dtype: str = "auto", device: str = "cpu", seed: int = 0,
                 tokenizer: str | Path | None = None, dequantize: bool = False, **engine_args):
        _check_llm_args(model, dtype, device, seed, tokenizer)
        if not isinstance(dequantize, bool):
            raise ValueError(f"dequantize must be a bool, got {dequantize!r}")
        built = build_engine(model, dtype=dtype, device=device, seed=seed, tokenizer=tokenizer,
                             dequantize=dequantize, **engine_args)
        # Kimi tokenizer files (tiktoken.model + tokenizer_config.json): ``tokenizer`` or the model directory
        self._tokenizer_dir = built.tokenizer_dir
        self._tokenizer = None
        self._sessions: dict = {}  # session_id -> SessionEncoder
        self.config = built.config
        self.engine = built.engine

    @property
    def tokenizer(self):
        """The Kimi tokenizer (loaded on first use). Raises ValueError when none was given."""
        if self._tokenizer is None:
            if self._tokenizer_dir is None:
                raise ValueError("no tokenizer: pass LLM(..., tokenizer=DIR) with tiktoken.model and "
                                 "tokenizer_config.json (a preset has none)")
            from kvtier.tokenize import load_tokenizer
            from kvtier.tokenize.formats import model_chat_format

            # the model's config.json says which chat format it speaks (K3: XTML over K2's BPE vocabulary)
            self._tokenizer = load_tokenizer(self._tokenizer_dir, model_chat_format(self.config.model_type))
        return self._tokenizer

    def _attach_tokenizer(self) -> None:
        if self.engine.tokenizer is None:
            self.engine.attach_tokenizer(self.tokenizer)

    def chat(self, messages: Seq[dict], tools: Seq[dict] | None = None,
             sampling_params: SamplingParams | None = None, session_id=None, tool_choice=None, *,
             thinking: dict | None = None, reasoning_effort: str | None = None,
             response_format: dict | None = None) -> RequestOutput:
        """Generate the assistant's next turn for an OpenAI-style conversation.

        The conversation is rendered in the model's chat format (its tokenizer's
        ``chat_format``: Kimi K2's template, or K3's XTML) and encoded by a per-session encoder
        (``session_id`` given: kept across calls, so a growing conversation encodes only what
        changed, until :meth:`end_session` drops it; None: a one-off encoder). With ``tools`` the
        turn is decoded under the tool grammar (``sampling_params.tools`` set to ``tools`` unless
        it names its own; ``tool_choice`` overrides ``sampling_params.tool_choice``). The output
        carries ``content``, ``reasoning_content`` and ``tool_calls`` (``token_ids`` too).

        ``thinking`` (``{"type": "enabled" | "disabled", "effort"?: ...}``), ``reasoning_effort``
        (``low`` / ``high`` / ``max``) and ``response_format`` shape a K3 prompt
        (:func:`kvtier.serve.chat.chat_prompt_options`); a K2 model takes none of them.

        Raises:
            ValueError: no tokenizer, bad messages/tools (naming ``messages[i].field`` or
            ``tools[i]...``), a bad K3 field (naming it), or K3 fields for a K2 model.
        """
        from kvtier.serve.chat import add_chat_request, chat_prompt_options, chat_sampling_params, new_encoder

        if session_id is not None:
            check_hashable("session_id", session_id)
        params = chat_sampling_params(sampling_params, tools, tool_choice, response_format)
        options = chat_prompt_options(self.tokenizer.chat_format, params, tools=tools, tool_choice=tool_choice,
                                      thinking=thinking, reasoning_effort=reasoning_effort,
                                      response_format=response_format)
        if options is None and (thinking, reasoning_effort, response_format) != (None, None, None):
            raise ValueError("thinking / reasoning_effort / response_format: K3's prompt fields; this model speaks "
                             "K2's template, which takes none of them")
        self._attach_tokenizer()
        enc = self._sessions.get(session_id) if session_id is not None else None
        if enc is None:
            enc = new_encoder(self.engine, self.tokenizer)
            if session_id is not None:
                self._sessions[session_id] = enc
        rid = add_chat_request(self.engine, enc, messages, params, prompt_options=options)
        return self._run([rid])[0]

    def end_session(self, session_id) -> bool:
        """Drop the encoder :meth:`chat` keeps for ``session_id`` (with its token buffer).

        Call it when a conversation is over: encoders are kept until then. A later :meth:`chat`
        with the same id starts a new encoder. Cached KV blocks are not affected.

        Args:
            session_id: an id given to :meth:`chat`; an unknown id (or None) is not an error.

        Returns:
            True if an encoder was dropped, False if ``session_id`` had none.
        """
        return self._sessions.pop(session_id, None) is not None

    def generate(self, prompts=None, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 prompt_token_ids: Seq[Seq[int]] | None = None) -> list[RequestOutput]:
        """Generate for each prompt; returns one :class:`RequestOutput` per prompt, in order.

        Args:
            prompts: text prompts; need a tokenizer, which this package does not load yet (use
                ``prompt_token_ids``).
            sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
            prompt_token_ids: list of prompts as token id lists.

        Raises:
            ValueError: text prompts, a mismatched ``sampling_params`` list, an empty prompt, a
            token id outside [0, vocab_size) or a prompt longer than max_position_embeddings.
            All prompts are checked before any is queued; if generation is interrupted, this
            call's unfinished requests are dropped and the engine keeps serving. A request whose
            sampling fails (or whose tool grammar does not compile) finishes with
            ``finish_reason="error"`` and its ``error`` message. Requests with ``tools`` need
            ``LLM(..., tokenizer=DIR)``; their outputs carry ``content`` and ``tool_calls``.
        """
        if prompts is not None:
            raise ValueError("prompts takes text, which needs a tokenizer (not loaded yet); pass token ids as "
                             "prompt_token_ids=[[...], ...]")
        if prompt_token_ids is None:
            raise ValueError("prompt_token_ids is required")
        containers = Seq | np.ndarray | torch.Tensor
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, containers):
            raise ValueError("prompt_token_ids must be a list of prompts (lists of ints or 1-D integer arrays), got "
                             f"{type(prompt_token_ids).__name__}")
        if len(prompt_token_ids) and not isinstance(prompt_token_ids[0], Seq | np.ndarray | torch.Tensor):
            prompt_token_ids = [prompt_token_ids]  # one prompt given as a flat list of ids
        n = len(prompt_token_ids)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams | Seq) or isinstance(params, str):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
        params_list = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != n:
            raise ValueError(f"sampling_params has {len(params_list)} entries for {n} prompts")
        for i, sp in enumerate(params_list):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        if any(sp.tool_grammar is not None for sp in params_list) and self._tokenizer_dir is not None:
            self._attach_tokenizer()
        prompts_checked = [self.engine.check_request(p, sp, i)
                           for i, (p, sp) in enumerate(zip(prompt_token_ids, params_list))]
        return self._run([self.engine.add_request(p, sp, i)
                          for i, (p, sp) in enumerate(zip(prompts_checked, params_list))])

    def _run(self, ids: list[int]) -> list[RequestOutput]:
        """Step the engine until requests ``ids`` finish; their outputs in that order."""
        done: dict[int, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    done[out.request_id] = out
        except BaseException:
            # Interrupted (Ctrl-C) or failed: drop this call's unfinished requests so the engine
            # keeps serving later calls; cached blocks stay.
            self.engine.abort([i for i in ids if i not in done])
            raise
        return [done[i] for i in ids]
