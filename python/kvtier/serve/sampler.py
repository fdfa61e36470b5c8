"""The step's tokens and logprobs from the rows that sample, in one batched call (nano-vllm's
``layers/sampler.py`` role); grammar masks come in as input (:mod:`kvtier.serve.grammar_runtime`)."""

from __future__ import annotations

import torch

from kvtier import ops
from kvtier.serve.penalties import apply_penalties
from kvtier.serve.request import Sequence


class Sampler:
    """Samples the step's rows, each under its own parameters and generator.

    Args:
        generator: the engine's generator (rows of requests without a seed draw from it).
        runner: the engine's runner; the sampling op runs on its model's current backend
            (``set_backend`` may change it), ``torch`` for a runner without a model (the simulator's).
    """

    def __init__(self, generator: torch.Generator, runner):
        self.generator, self.runner = generator, runner

    def backend(self) -> str:
        model = getattr(self.runner, "model", None)
        return model.backend if model is not None else "torch"

    def sample(self, rows: list[tuple[Sequence, torch.Tensor, object]]) -> dict[int, int | Exception]:
        """The step's tokens of the sequences that sample, in one :func:`kvtier.ops.sample` call
        (none when every row is greedy, unconstrained and without penalties: each row's argmax).

        Args:
            rows: ``(seq, next_token_logits, token_bitmask)`` per sequence, logits [vocab] fp32;
                ``token_bitmask`` is the ``[1, ceil(vocab / 32)]`` int32 allowed tokens of a
                constrained sequence, the message of the error that left it without one, or None.

        Each row samples under its own temperature / top-p, its grammar mask (rows without one
        allow every token) and its own generator (its seed's, else the engine's): one uniform
        per sampled row, so a seeded request gets the same tokens whatever it is batched with.
        Then each constraint takes its token (it may replace one that leaves no room to finish
        the turn) and the logprobs asked for are read in one pass.

        Returns:
            by ``seq_id``: the token, or the exception that failed that request (a grammar error
            fails its request only; a failing sampling call fails every request in it).
        """
        out: dict[int, int | Exception] = {}
        live = []
        for seq, logits, mask in rows:
            if isinstance(mask, str):
                from kvtier.toolcall import GrammarError

                out[seq.seq_id] = GrammarError(mask)
            else:
                live.append((seq, logits, mask))
        if not live:
            return out
        try:
            if _argmax_only(live):  # each row's argmax, without a copy of the rows
                # max(0).indices: argmax's first-maximum and NaN rule, 2.7x faster on a 163,840-entry
                # fp32 row than argmax (torch 2.13, one CPU core)
                logits, sampled = None, [int(row.max(0).indices) for _, row, _ in live]
            else:
                logits = torch.stack([row for _, row, _ in live])  # [rows, vocab]: one copy, for both uses
                sampled = self._sample_rows(live, logits)
        except Exception as e:  # noqa: BLE001 - the step's other requests keep going
            return out | {seq.seq_id: e for seq, _, _ in live}
        want_logprobs = []
        for i, (seq, _, _) in enumerate(live):
            try:
                if seq.constraint is not None:
                    sampled[i] = seq.constraint.take(sampled[i])
            except Exception as e:  # noqa: BLE001 - this request only
                out[seq.seq_id] = e
                continue
            out[seq.seq_id] = sampled[i]
            if seq.params.logprobs:
                want_logprobs.append(i)
        if want_logprobs:
            if logits is None:
                logits = torch.stack([row for _, row, _ in live])
            failed = self._logprobs(live, logits, sampled, want_logprobs)
            if failed is not None:
                return out | {live[i][0].seq_id: failed for i in want_logprobs}
        return out

    def _logprobs(self, live, logits: torch.Tensor, sampled: list[int], want: list[int]) -> Exception | None:
        """Append each wanted row's logprob (and top logprobs) to its sequence; the exception
        that failed them all, or None."""
        try:
            rows = logits[torch.tensor(want, device=logits.device)]
            picked = torch.tensor([sampled[i] for i in want], device=logits.device)
            lsm = torch.log_softmax(rows, -1)
            values = lsm.gather(1, picked[:, None]).squeeze(1).tolist()
            k = max(live[i][0].params.top_logprobs for i in want)
            top = torch.topk(lsm, k, dim=-1) if k else None
            top_ids, top_vals = (top.indices.tolist(), top.values.tolist()) if k else ([], [])
        except Exception as e:  # noqa: BLE001 - fails the requests that asked for logprobs
            return e
        for j, (i, v) in enumerate(zip(want, values)):
            seq = live[i][0]
            seq.logprobs.append(float(v))
            if seq.params.top_logprobs:
                n = seq.params.top_logprobs
                seq.top_logprobs.append(list(zip(top_ids[j][:n], top_vals[j][:n])))
        return None

    def _sample_rows(self, live, logits: torch.Tensor) -> list[int]:
        """One ``ops.sample`` over the rows of :meth:`sample` (no error messages among them);
        ``logits``: their rows stacked, [len(live), vocab] fp32."""
        dev = logits.device
        params = [seq.params for seq, _, _ in live]
        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        masked = [i for i, (_, _, mask) in enumerate(live) if mask is not None]
        token_bitmask = None
        if masked:  # rows without a grammar allow every token (all 32 bits of each word set)
            token_bitmask = torch.full((len(live), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32, device=dev)
            token_bitmask[torch.tensor(masked, device=dev)] = torch.cat(
                [live[i][2] for i in masked]).to(dev, non_blocking=True)
        generators = [seq.generator or self.generator for seq, _, _ in live]
        # sampling-parameter plumbing: presence / frequency penalties (a copy; logprobs read the model's)
        logits = apply_penalties(logits, [(seq.output_token_ids, seq.params.presence_penalty,
                                           seq.params.frequency_penalty) for seq, _, _ in live])
        tokens = ops.sample(logits, temperature.to(dev), top_p.to(dev), token_bitmask=token_bitmask,
                            generator=generators, backend=self.backend())
        return tokens.tolist()


def _argmax_only(rows) -> bool:
    """Whether every row of :meth:`Sampler.sample` is greedy, without a grammar mask and without
    penalties: its token is the argmax of its logits, as ``ops.sample`` gives a greedy row (which
    draws no uniform), so the step needs neither the sampling call nor a copy of the rows."""
    return all(mask is None and seq.params.greedy and not (seq.params.presence_penalty or seq.params.frequency_penalty)
               for seq, _, mask in rows)


def prompt_logprobs(seq: Sequence, res) -> None:
    """Fill ``seq.prompt_logprobs`` from a step result's prompt logits (``res.prompt_logits``
    [positions, vocab] at ``res.prompt_positions``); None or no prompt logits: nothing."""
    if res is not None and res.prompt_logits is not None:
        targets = torch.tensor([seq.prompt_token_ids[p + 1] for p in res.prompt_positions])
        lp = torch.log_softmax(res.prompt_logits, -1).gather(1, targets[:, None].to(res.prompt_logits.device))
        # Positions it reports as cached stay None, also when a preemption made it recompute
        # them (``num_cached_tokens`` is its first admission's; RequestOutput's contract).
        for p, v in zip(res.prompt_positions, lp.squeeze(1).tolist()):
            if p >= seq.num_cached_tokens:
                seq.prompt_logprobs[p] = v


__all__ = ["Sampler", "prompt_logprobs"]
