"""Request intake: a prompt checked against the engine it is sent to, and the block hashes it
brings checked against the prompt (the engine never serves a block by a hash it has not
verified)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np
import torch

from kvtier.cache.block_hash import BLOCK_HASH_BYTES, block_hashes
from kvtier.options import is_int
from kvtier.serve.config import EngineConfig
from kvtier.serve.params import SamplingParams
from kvtier.tokenize.buffer import TokenBuffer


class Intake:
    """The checks of one engine.

    Args:
        config: the engine's config (page size, device pages).
        model_config: the model's (``vocab_size``, ``max_position_embeddings``).
        block_hash_salt: the salt of the engine's block hashes.
    """

    def __init__(self, config: EngineConfig, model_config, block_hash_salt: bytes):
        self.config, self.model_config, self.block_hash_salt = config, model_config, block_hash_salt

    def check_request(self, prompt_token_ids, params: SamplingParams, index: int = 0, *,
                      has_tokenizer: bool = True) -> list[int]:
        """The prompt as a list of Python ints, after checking it fits this engine.

        Raises:
            ValueError: an empty prompt, a token id outside [0, vocab_size), a prompt longer than
            max_position_embeddings, or one that cannot fit in the page pool; the message names
            ``prompt_token_ids[index]``. A tool grammar without a tokenizer.
        """
        vocab = self.model_config.vocab_size
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params[{index}] must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_token_ids, (str, bytes, dict)) or not isinstance(prompt_token_ids, Iterable) or (
                isinstance(prompt_token_ids, (np.ndarray, torch.Tensor)) and prompt_token_ids.ndim != 1):
            raise ValueError(f"prompt_token_ids[{index}] must be a list of ints or a 1-D integer array, got "
                             f"{type(prompt_token_ids).__name__}")
        prompt = _checked_int_array(prompt_token_ids, vocab)
        if prompt is None:  # not an in-range integer array: check (and name) each id
            prompt = [_as_int(t) for t in prompt_token_ids]
            for j, t in enumerate(prompt):
                if not is_int(t) or not 0 <= t < vocab:
                    raise ValueError(f"prompt_token_ids[{index}][{j}] = {t!r} must be an int in [0, vocab_size={vocab})")
        self.check_fits(len(prompt), params, f"prompt_token_ids[{index}]")
        if params.tool_grammar is not None and not has_tokenizer:
            raise ValueError(f"sampling_params[{index}].tools needs a tokenizer: build the engine through "
                             "LLM(..., tokenizer=DIR) or call Engine.attach_tokenizer(tokenizer)")
        return prompt

    def check_fits(self, num_tokens: int, params: SamplingParams, where: str) -> None:
        """Raise ValueError (naming ``where``) when a prompt of ``num_tokens`` tokens is empty, longer
        than the context, or with its output cannot fit in the page pool."""
        max_pos = self.model_config.max_position_embeddings
        if num_tokens == 0:
            raise ValueError(f"{where} is empty; a prompt needs at least one token")
        if num_tokens > max_pos:
            raise ValueError(f"{where} has {num_tokens} tokens, more than max_position_embeddings={max_pos}")
        if params.refuse_past_context and num_tokens + params.max_tokens > max_pos:  # sampling-parameter plumbing
            raise ValueError(f"max_tokens: {where} has {num_tokens} tokens and max_tokens is {params.max_tokens}: "
                             f"{num_tokens + params.max_tokens} tokens in all, more than the context "
                             f"(max_position_embeddings={max_pos}); lower max_tokens or shorten the prompt")
        ps, num_pages = self.config.pool.page_size, self.config.pool.num_device_pages
        pages_for = lambda tokens: -(-(tokens - 1) // ps)  # noqa: E731 - the last token is never cached
        pages = pages_for(min(num_tokens + params.max_tokens, max_pos))
        if pages > num_pages:
            # the prompt alone fits: the output's room is what the pool lacks
            cause = "max_tokens: " if pages_for(num_tokens) <= num_pages else ""
            raise ValueError(f"{cause}{where} with max_tokens={params.max_tokens} needs {pages} pages of "
                             f"{ps} tokens, more than num_device_pages={num_pages}")

    def prompt_hashes(self, prompt_token_ids, prompt: list[int], given, index: int, salt: bytes) -> list[bytes]:
        """The block hashes of ``prompt`` (``prompt_token_ids`` as checked) from ``given``: None
        (none), or the chained hashes of the prompt's full pages, either

        - the :class:`kvtier.tokenize.TokenBuffer` the prompt was appended to (a session
          encoder's, see :func:`kvtier.serve.chat.new_encoder`): its hashes were computed
          by the buffer from its own ids as they were appended, so they are taken without
          hashing again once its ids equal the prompt (one compare of the ids), its
          ``page_size`` is the pool's and its ``salt`` is :attr:`block_hash_salt` +
          ``request_salt(cache_salt)``; or
        - a list of hashes from elsewhere (``block_hashes(prompt, page_size,
          salt=block_hash_salt + request_salt(cache_salt))[:n]``, ``n <= len(prompt) //
          page_size``). The engine never serves a block by a hash it has not verified:
          such a chain is recomputed from the prompt (one native pass, GIL released,
          about 1 ms per 100K tokens at page_size 64) and compared, so a chain built with
          another salt, page size or prompt, or one whose earlier hashes were swapped for
          another tenant's, is rejected.

        Either way the pool gets them and hashes only the blocks past them (the output's).

        Raises:
            ValueError: hashes that are too many, not 16-byte ``bytes``, or do not match the
                prompt (a token buffer: other ids, another page size or another salt).
        """
        if given is None:
            return []
        if isinstance(given, TokenBuffer):
            return self._buffer_hashes(prompt_token_ids, given, index, salt)
        return self._checked_hashes(prompt, given, index, salt)

    def check_hashed(self, num_prompt_tokens: int, hashes: list[bytes], params: SamplingParams) -> None:
        """The checks of :meth:`kvtier.serve.engine.Engine.add_hashed_request`.

        Raises:
            ValueError: the prompt does not fit (:meth:`check_fits`), fewer hashes than the full
                pages of prompt and ``max_tokens``, or ``params`` asks for logprobs or a tool
                grammar (there are no logits).
        """
        where = f"prompt of {num_prompt_tokens} tokens"
        self.check_fits(num_prompt_tokens, params, where)
        need = (num_prompt_tokens + params.max_tokens) // self.config.pool.page_size
        if len(hashes) < need:
            raise ValueError(f"{where}: block_hashes has {len(hashes)} hashes; its {need} full pages of "
                             f"page_size={self.config.pool.page_size} (prompt and max_tokens) need one each")
        if params.logprobs or params.prompt_logprobs or params.tool_grammar is not None:
            raise ValueError(f"{where}: a request without token ids has no logprobs or tool grammar")

    def _buffer_hashes(self, prompt_token_ids, buf: TokenBuffer, index: int, salt: bytes) -> list[bytes]:
        """The hashes ``buf`` keeps, after its checks (no hashing: the native buffer hashed each
        page once, as its ids were appended)."""
        try:
            return buf.chain_for(prompt_token_ids, self.config.pool.page_size, self.block_hash_salt + salt)
        except ValueError as e:
            raise ValueError(f"prompt_block_hashes for prompt {index}: {e} (a TokenBuffer built for another "
                             "engine, tenant or prompt?)") from None

    def _checked_hashes(self, prompt: list[int], hashes: Seq[bytes], index: int, salt: bytes = b"") -> list[bytes]:
        """``hashes`` as a list after checking them against the prompt (recomputed, compared)."""
        where = f"prompt_block_hashes for prompt {index}"
        if isinstance(hashes, (bytes, bytearray, str)) or not isinstance(hashes, Seq):
            raise ValueError(f"{where}: expected a list of {BLOCK_HASH_BYTES}-byte hashes, got {type(hashes).__name__}")
        hashes = list(hashes)
        ps, n = self.config.pool.page_size, len(hashes)
        if n > len(prompt) // ps:
            raise ValueError(f"{where}: {n} hashes for a prompt of {len(prompt)} tokens; at most "
                             f"{len(prompt) // ps} full pages of page_size={ps}")
        if n == 0:
            return hashes
        if not all(isinstance(h, bytes) and len(h) == BLOCK_HASH_BYTES for h in hashes):
            raise ValueError(f"{where}: each hash must be {BLOCK_HASH_BYTES} bytes")
        own = block_hashes(prompt[:n * ps], ps, None, self.block_hash_salt + salt)
        if own != hashes:
            bad = next(i for i, (a, b) in enumerate(zip(own, hashes)) if a != b)
            raise ValueError(f"{where}: hash {bad} does not match the prompt's page {bad} with page_size={ps} "
                             "and this engine's block_hash_salt (a TokenBuffer built for another engine, or "
                             "another prompt?)")
        return own


def _checked_int_array(ids, vocab: int) -> list[int] | None:
    """``ids`` as a list when it is a 1-D integer numpy array with every id in [0, vocab), else None."""
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        return None
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return None
    return ids.tolist()


def _is_bool(t) -> bool:
    """A Python, numpy or torch boolean (never a token id, though ``operator.index`` takes some)."""
    return isinstance(t, (bool, np.bool_)) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool)


def _as_int(t):
    """Python int for any integer-like token id (numpy/torch scalars too); other values unchanged."""
    if _is_bool(t):
        return t
    try:
        return operator.index(t)
    except TypeError:
        return t


def request_salt(cache_salt: str) -> bytes:
    """The bytes a request's ``cache_salt`` adds after the engine's block-hash salt (empty for
    ""; tagged, so that no request salt equals a suffix of an engine's ``cache_salt``)."""
    return b"\0request-salt:" + cache_salt.encode() if cache_salt else b""


__all__ = ["Intake", "request_salt"]
