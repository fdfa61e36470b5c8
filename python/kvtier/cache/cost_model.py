"""The load decision: load a cached run only when that is faster than recomputing it.

``load_s(tier, nbytes) = latency_s + nbytes / bandwidth_Bps`` per tier, and
``recompute_s(num_tokens) = num_tokens / prefill_tok_s``. Tier rates come from a short probe
at start-up and are updated from observed copies; the prefill rate from observed steps. Both
updates are exponentially weighted moving averages (weight ``alpha`` on the new sample).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.cache.prefix_index import Tier


@dataclass
class TierCost:
    """Latency (s per copy job) and bandwidth (bytes/s) of loading from a tier into device pages."""

    latency_s: float
    bandwidth_Bps: float

    def load_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


# Used for a tier the start-up probe could not measure (e.g. a full disk): 1 ms and 1 GB/s, a
# conservative NVMe-class figure; observed copies then correct it.
UNPROBED_TIER = TierCost(latency_s=1e-3, bandwidth_Bps=1e9)

# Start-up cost of the remote tier (not probed: a probe would write to a shared store): 2 ms
# per batched call and 0.5 GB/s, the order of Redis and Mooncake Store over loopback TCP
# (batched gets of 1 MiB values measured at 0.3-0.7 GB/s); observed loads then correct it.
REMOTE_TIER = TierCost(latency_s=2e-3, bandwidth_Bps=5e8)


@dataclass
class CostModel:
    """Per-tier load costs and the prefill rate, with online updates.

    Attributes:
        tiers: cost of loading from each lower tier (DEVICE hits cost nothing).
        prefill_tok_s: measured prefill throughput in tokens per second.
        alpha: EWMA weight of a new observation.
    """

    tiers: dict[Tier, TierCost] = field(default_factory=dict)
    prefill_tok_s: float = 1000.0
    alpha: float = 0.2

    def load_s(self, tier: Tier, nbytes: int) -> float:
        """Seconds to load ``nbytes`` from ``tier``; an unprobed tier gets :data:`UNPROBED_TIER`."""
        if tier == Tier.DEVICE:
            return 0.0
        return self.tiers.get(tier, UNPROBED_TIER).load_s(nbytes)

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tok_s

    def blocks_to_load(self, sources: Sequence[Tier] | np.ndarray, block_bytes: int, page_size: int) -> int:
        """How many leading blocks of a matched run to take.

        ``sources[i]`` is the fastest tier holding block i (a :class:`Tier`, or its value in an
        int array). The loads of one prefix are submitted together and overlap, so a tier's
        latency is paid once per prefix and its bandwidth per block. Returns the prefix length with the largest saving
        ``recompute_s(k * page_size) - load time`` (the shortest such length on a tie); 0 when
        nothing saves time. One array pass: prompts reach 10^5 one-token blocks.
        """
        if not len(sources):
            return 0
        spent = np.cumsum(self._block_load_s(sources, block_bytes))
        saving = np.arange(1, len(sources) + 1) * (page_size / self.prefill_tok_s) - spent
        k = int(np.argmax(saving))
        return k + 1 if saving[k] > 0 else 0

    def best_resume_point(self, sources: Sequence[Tier] | np.ndarray, block_bytes: int, page_size: int,
                          points: Sequence[tuple[int, Tier]], checkpoint_bytes: int) -> int:
        """Which resume point of a hybrid model's matched prefix to restore (an index into
        ``points``), or -1 to compute the prompt from its first token.

        ``points[j] = (k, tier)``: the state checkpoint after the first ``k`` blocks (``k >= 1``)
        is reachable in ``tier``; ``sources`` the fastest tier of each matched block, as in
        :meth:`blocks_to_load`. A point saves ``recompute_s(k * page_size)`` minus the load of its
        ``k`` blocks and of its ``checkpoint_bytes`` checkpoint; the largest positive saving wins
        (the earliest point on a tie). Comparing every point prices a checkpoint load against
        recomputing from the cheaper point before it: loading a large state to skip a few hundred
        tokens past a device-resident checkpoint is not taken.
        """
        if not points or not len(sources):
            return -1
        spent = np.cumsum(self._block_load_s(sources, block_bytes))
        best, best_saving = -1, 0.0
        for j, (k, tier) in enumerate(points):
            saving = k * page_size / self.prefill_tok_s - spent[k - 1] - self.load_s(tier, checkpoint_bytes)
            if saving > best_saving or (saving == best_saving and best >= 0 and k < points[best][0]):
                best, best_saving = j, saving
        return best

    def prefix_load_s(self, sources: Sequence[Tier] | np.ndarray, block_bytes: int) -> float:
        """Seconds to load the blocks of one prefix from ``sources`` (one tier per block;
        DEVICE blocks cost nothing), ``block_bytes`` bytes each: each tier's latency once, its
        bandwidth per block; 0.0 for no blocks."""
        return float(self._block_load_s(sources, block_bytes).sum()) if len(sources) else 0.0

    def _block_load_s(self, sources: Sequence[Tier] | np.ndarray, block_bytes: int) -> np.ndarray:
        """Per block of ``sources``, the seconds it adds to its prefix's load: its bytes over its
        tier's bandwidth, plus the tier's latency at the tier's first block."""
        src = np.asarray(sources, dtype=np.int64)
        per_block = np.zeros(len(src))
        for tier in np.flatnonzero(np.bincount(src, minlength=1)).tolist():
            if tier == Tier.DEVICE:
                continue
            cost = self.tiers.get(Tier(tier), UNPROBED_TIER)
            at = src == tier
            per_block[at] = block_bytes / cost.bandwidth_Bps
            per_block[int(np.argmax(at))] += cost.latency_s
        return per_block

    def observe_copy(self, tier: Tier, nbytes: int, seconds: float, share: float = 1.0) -> None:
        """Fold one observed load (``nbytes`` in ``seconds`` of copy time, as the copy engine
        measured it on its worker: no queueing) into the tier's bandwidth.

        ``share`` (in ``(0, 1]``): the load's part of the copy job it ran in, ``1 / n`` for one of
        ``n`` blocks copied together, whose ``seconds`` are the job's over ``n``: the job pays the
        tier's latency once, and its ``n`` blocks together move the estimate as one observation
        of the job (EWMA weight ``1 - (1 - alpha) ** share`` each). Folded as ``n`` whole
        observations, one job of a thousand 1-token blocks replaced the estimate with its own
        rate, and one slow job could make loading look slower than recomputing from then on.
        """
        if seconds <= 0 or nbytes <= 0 or tier == Tier.DEVICE:
            return
        cost = self.tiers.setdefault(tier, TierCost(UNPROBED_TIER.latency_s, UNPROBED_TIER.bandwidth_Bps))
        rate = nbytes / max(seconds - share * cost.latency_s, seconds * 0.1)
        cost.bandwidth_Bps += (1.0 - (1.0 - self.alpha) ** share) * (rate - cost.bandwidth_Bps)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Fold one observed prefill step into ``prefill_tok_s``."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_tok_s += self.alpha * (num_tokens / seconds - self.prefill_tok_s)


PROBE_BULK_BYTES = 4 << 20
"""Bytes of the many-block job :func:`probe` measures a tier's bandwidth with (at most)."""


def probe(copy: Callable[[int], int], max_blocks: int = 1, repeats: int = 3) -> TierCost:
    """Measure a tier: ``copy(n)`` performs one copy job of ``n`` blocks and returns the bytes moved.

    With ``max_blocks`` > 1 the latency is the fastest one-block job and the bandwidth the extra
    bytes of a ``max_blocks`` job over its extra time (the median job of each size): a job of one
    small block measures the job's fixed cost, not the tier's bandwidth (one-token blocks of
    960 bytes probed at 1-15 MB/s against ~9 GB/s in bulk; at the low end loading looked slower
    than recomputing, so nothing was loaded, nothing observed, and the estimate never
    recovered). With ``max_blocks`` 1 (a tier loaded one block per job, as the disk is) the
    bandwidth is the median one-block rate, and the latency a tenth of the fastest job. Used at
    pool start-up (a few jobs, well under a second).
    """
    def median_job(n: int) -> tuple[float, float, int]:
        times, nbytes = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            nbytes = copy(n)
            times.append(time.perf_counter() - t0)
        times.sort()
        return times[0], times[len(times) // 2], nbytes

    fastest, one_s, one_bytes = median_job(1)
    if max_blocks <= 1:
        return TierCost(latency_s=fastest * 0.1, bandwidth_Bps=max(one_bytes, 1) / max(one_s, 1e-9))
    _, bulk_s, bulk_bytes = median_job(max_blocks)
    extra_s = bulk_s - one_s
    bandwidth = (bulk_bytes - one_bytes) / extra_s if extra_s > 0 else bulk_bytes / max(bulk_s, 1e-9)
    return TierCost(latency_s=fastest, bandwidth_Bps=bandwidth)
