"""``GET /metrics``: Prometheus text format through ``prometheus_client``, one registry per server.

Request-level series (histograms of TTFT and TPOT, token and request counters) are updated as
requests end; engine and pool series (queue depth, running requests, device pages, hit tokens
and bytes per tier, copy errors, preemptions, engine steps, every counter of each of the pool's
sections (``stats().pool.sections``, each a series as the cache declares it) and the ``kvtier_grammar_*``
series of tool-grammar compiles, mask work and requests a grammar limit ended) are read, when scraped,
from the engine thread's last published snapshot only
(:class:`kvtier.serve.api.worker.WorkerStats`: the scheduler's, the pool's and the engine's
frozen ``stats()``, refreshed after each step and every 0.2 s while idle), never from the
engine, its scheduler or its pool.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier.cache.pool_stats import series_table
from kvtier.serve.api.jobs import Final

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _EngineCollector:
    def __init__(self, snapshot, probe_prefill_tokens: int = 0):
        self.snapshot = snapshot  # () -> WorkerStats | None
        self.probe_prefill_tokens = probe_prefill_tokens  # the start-up probe's, not a client's

    def collect(self):
        w = self.snapshot()
        if w is None:
            return
        e = w.engine
        sched, kv = e.scheduler, e.pool
        running, used = sched.running + sched.loading, kv.num_pages - kv.num_free_pages
        gauges = [("kvtier_requests_waiting", "requests queued in the scheduler", sched.waiting),
                  ("kvtier_requests_running", "requests running or loading their prefix", running),
                  ("kvtier_device_pages_total", "device KV pages per layer", kv.num_pages),
                  ("kvtier_device_pages_used", "device KV pages held by requests", used),
                  ("kvtier_sessions", "chat sessions kept by the server", w.sessions),
                  ("kvtier_sessions_waiting_on_tools", "sessions whose last turn ended in tool calls, until their "
                   "next request", w.sessions_waiting)]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [("kvtier_copy_errors", "failed tier copies (each ended in recomputation)", kv.copy_errors),
                    ("kvtier_preemptions", "running requests preempted for pages", sched.preemptions),
                    ("kvtier_prefill_tokens", "prompt tokens computed (not served from a cache; the start-up "
                     "probe's excluded)", e.prefill_tokens - self.probe_prefill_tokens),
                    ("kvtier_sessions_expired", "sessions dropped after their idle TTL", w.sessions_expired),
                    ("kvtier_sessions_evicted", "sessions evicted by the session store's token limit "
                     "(--session-store-tokens)", w.sessions_evicted),
                    ("kvtier_engine_errors", "engine steps that failed", w.engine_errors),
                    ("kvtier_engine_busy_seconds", "seconds the engine spent stepping (utilisation: its rate)",
                     w.busy_s)]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        blocks = GaugeMetricFamily("kvtier_cached_blocks", "blocks with a cached copy, by tier", labels=["tier"])
        for tier, v in sorted(kv.cached_blocks.items()):
            blocks.add_metric([tier], v)
        yield blocks
        for name, doc, counts in [("kvtier_hit_tokens", "prompt tokens served from cached blocks, by tier",
                                   kv.hit_tokens),
                                  ("kvtier_bytes_loaded", "bytes loaded into device pages, by source tier",
                                   kv.bytes_loaded),
                                  ("kvtier_bytes_written", "bytes written to a lower tier, by tier",
                                   kv.bytes_written),
                                  ("kvtier_evictions", "blocks evicted, by tier", kv.evictions)]:
            fam = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, v in sorted(counts.items()):
                fam.add_metric([tier], v)
            yield fam
        yield from _resume_families(w.resume)
        for section in kv.sections.values():  # what this pool keeps beyond blocks (remote, state)
            yield from _section_families(section)
        yield CounterMetricFamily("kvtier_engine_steps", "engine steps completed", value=e.steps)
        if e.grammar is not None:  # the tool-grammar compiler exists (a request with tools came)
            yield from _grammar_families(e.grammar)


def _grammar_families(g: dict):
    compiles = CounterMetricFamily("kvtier_grammar_compiles", "tool grammars compiled by llguidance, by result",
                                   labels=["result"])
    compiles.add_metric(["ok"], g["compiles"] - g["compile_errors"])
    compiles.add_metric(["error"], g["compile_errors"])
    yield compiles
    yield CounterMetricFamily("kvtier_grammar_compile_seconds", "seconds spent compiling tool grammars",
                              value=g["compile_s"])
    yield CounterMetricFamily("kvtier_grammar_cache_hits", "tool grammars served from the compile cache",
                              value=g["cache_hits"])
    yield CounterMetricFamily("kvtier_grammar_masks", "token masks computed for constrained requests", value=g["masks"])
    yield CounterMetricFamily("kvtier_grammar_mask_seconds", "seconds spent computing token masks and closing plans",
                              value=g["mask_s"])
    yield CounterMetricFamily("kvtier_grammar_closing_out_of_fuel", "searches for a short completion that ran out "
                              "of closing_fuel (the turn went on under its mask alone)", value=g["out_of_fuel"])
    cut = CounterMetricFamily("kvtier_grammar_requests_cut", "requests a grammar limit ended: compile (refused), "
                              "deadline (a token's grammar work missed mask_deadline_s), parser (an llguidance limit "
                              "while decoding)", labels=["limit"])
    for kind, v in sorted(g["cut"].items()):
        cut.add_metric([kind], v)
    yield cut


def _resume_families(r: dict):
    yield CounterMetricFamily("kvtier_resumes", "turns resuming a session after a tool wait", value=r["resumes"])
    fam = CounterMetricFamily("kvtier_resume_slo_misses", "resumed turns whose TTFT missed --resume-ttft-s, by why "
                              "(evicted, prefetch_late, queued, prefill)", labels=["reason"])
    for reason, v in sorted(r["misses"].items()):
        fam.add_metric([reason], v)
    yield fam
    if r.get("target_s") is not None:  # absent without --resume-ttft-s: resumes counted, misses not
        yield GaugeMetricFamily("kvtier_resume_ttft_target_seconds", "the --resume-ttft-s target resumes are "
                                "counted against", value=r["target_s"])


def _section_families(section):
    """One counter family per field of a pool's section (:attr:`kvtier.cache.pool_stats.PoolSnapshot.sections`),
    named and described as the cache declares it (:func:`kvtier.cache.pool_stats.series_table`)."""
    for field, (name, doc, label) in series_table(section).items():
        value = getattr(section, field)
        if label is None:
            yield CounterMetricFamily(name, doc, value=value)
            continue
        fam = CounterMetricFamily(name, doc, labels=[label])
        for key, v in sorted(value.items()):
            fam.add_metric([key], v)
        yield fam


class ServerMetrics:
    """The server's Prometheus registry.

    Args:
        snapshot: returns the engine thread's last published
            :class:`kvtier.serve.api.worker.WorkerStats` (None before the first); the only
            source of the engine, scheduler and pool series.
        probe_prefill_tokens: tokens the server's start-up probe prefilled
            (:func:`kvtier.serve.api.server.warm_up`), left out of ``kvtier_prefill_tokens``.
    """

    def __init__(self, snapshot, probe_prefill_tokens: int = 0):
        self.probe_prefill_tokens = probe_prefill_tokens
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("kvtier_request_finish", "engine requests ended, by finish reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("kvtier_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvtier_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("kvtier_cached_prompt_tokens", "prompt tokens served from cached blocks",
                                     registry=r)
        self.disconnects = Counter("kvtier_client_disconnects", "requests aborted because the client left",
                                   registry=r)
        self.ttft = Histogram("kvtier_time_to_first_token_seconds", "TTFT (arrival at the engine to first token)",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvtier_time_per_output_token_seconds", "TPOT after the first token",
                              buckets=_TPOT_BUCKETS, registry=r)
        r.register(_EngineCollector(snapshot, probe_prefill_tokens))

    def observe_final(self, f: Final) -> None:
        """Count one finished request (called on the engine thread; prometheus_client is thread-safe)."""
        self.finished.labels(f.finish_reason).inc()
        self.prompt_tokens.inc(f.prompt_tokens)
        self.generation_tokens.inc(f.completion_tokens)
        self.cached_tokens.inc(f.cached_tokens)
        if f.ttft_s is not None:
            self.ttft.observe(f.ttft_s)
            if f.e2e_s is not None and f.completion_tokens > 1:
                self.tpot.observe((f.e2e_s - f.ttft_s) / (f.completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
