"""Cache-aware admission: cached requests are served beside a long cold prefill, not behind it;
aging bounds how long a cold request is passed over; a request waiting for pages for its
loads does not hold the requests behind it. Each test also runs FCFS, where the situation it
guards against happens, so the test shows the policy is what makes the difference.

The engines here run the real scheduler, engine step and pool over a model-free runner
(:class:`tests.helpers.engines.StandInLLM`: the tiny preset's page pools and limits, modelled
step times, tokens that depend only on a sequence's own ids); one test per policy runs the tiny
model end to end (``LLM("tiny")``)."""

import math

import pytest

from kvtier import LLM, SamplingParams
from kvtier.serve.ranking import DECODE_AGE_FACTOR, FAST_LANE_SHARE
from tests.helpers.engines import StandInLLM
from tests.helpers.scheduling import reconfigure
from tests.helpers.serving import BLOCK, N, ONE, PS, always_load, host_cached, occupy, prompt

BUDGET = 64  # max_num_batched_tokens of these engines
TWO = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def engine_for(policy: str, llm=StandInLLM, **kw):
    return llm("tiny", page_size=PS, num_device_pages=256, max_num_batched_tokens=BUDGET, schedule_policy=policy,
               **kw).engine


def alone_engine(num_device_pages=64):
    """A stand-in engine without prefix caching: what each request produces on its own."""
    return StandInLLM("tiny", page_size=PS, num_device_pages=num_device_pages, enable_prefix_caching=False)


def run_steps(engine, on_step=None, max_steps=500):
    """Step until idle; returns ``{request_id: step index of its first token}``."""
    first = {}
    step = 0
    while engine.has_unfinished():
        if on_step is not None:
            on_step(step)
        for out in engine.step():
            first.setdefault(out.request_id, step)
        for seq in engine.scheduler.running:
            if seq.output_token_ids:
                first.setdefault(seq.seq_id, step)
        step += 1
        assert step < max_steps, "did not finish"
    return first


@pytest.mark.parametrize("llm", [StandInLLM, LLM], ids=["stand-in", "tiny-model"])
@pytest.mark.parametrize("policy", ["cache-aware", "fcfs"])
def test_cached_requests_get_first_token_before_a_long_cold_prefill_ends(policy, llm):
    engine = engine_for(policy, llm=llm)
    shorts = [prompt(4 * PS + 1, 10 + i) for i in range(3)]
    for p in shorts:  # their 4 full blocks become device-cached
        engine.add_request(p, ONE)
    run_steps(engine)
    cold = engine.add_request(prompt(20 * PS, 99), ONE)  # 320 tokens: 5 steps of 64 on its own
    engine.step()  # the cold prefill is under way
    cached = [engine.add_request(p, ONE) for p in shorts]
    first = run_steps(engine)
    if policy == "cache-aware":
        assert all(first[rid] < first[cold] for rid in cached), first
    else:  # FCFS: the running prefill takes every step's budget; they wait for its last chunk
        assert all(first[rid] >= first[cold] for rid in cached), first


def test_cached_requests_report_their_hits_and_a_breakdown_that_sums_to_ttft():
    engine = engine_for("cache-aware")
    short = prompt(4 * PS + 1, 10)
    engine.add_request(short, ONE)
    run_steps(engine)
    engine.add_request(prompt(20 * PS, 99), ONE)
    engine.step()
    rid = engine.add_request(short, ONE)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    out, m = outs[rid], outs[rid].metrics
    assert out.num_cached_tokens == 4 * PS
    assert m.arrival_time <= m.admitted_time <= m.loaded_time <= m.first_token_time
    for o in outs.values():
        assert o.metrics.admitted_time is not None and o.metrics.loaded_time is not None


@pytest.mark.parametrize("pairs", [None, BUDGET * (BUDGET + 1) // 2], ids=["no-attention-budget", "fresh-chunk-pairs"])
@pytest.mark.parametrize("max_passes", [1, 4, 16])
def test_cold_request_under_a_stream_of_cheaper_ones_finishes_within_the_aging_bound(max_passes, pairs):
    """Bound: a request is passed over (a later arrival gets prefill tokens, it gets none) in at
    most ``schedule_max_passes`` steps; it then ranks first, is admitted once the prefill being
    chunked, if any, ends (one more step here). Then, as the chunked prefill, it gets at least
    half of every step's token budget unless the step's attention budget ``P`` (query-key pairs,
    charged to it first) cuts its chunk, and a cut chunk takes at least ``P - L`` pairs of the
    ``L (L + 1) / 2`` its prompt has. Here (no decodes) its first token comes within
    ``max_passes + 2 + ceil(L / (budget / 2)) + ceil(L (L + 1) / 2 / (P - L))`` steps of its
    arrival (the last term only with an attention budget), however fast the stream comes (the
    deadline rank may admit it sooner; the bound does not depend on timing)."""
    engine = engine_for("cache-aware", schedule_max_passes=max_passes, max_num_batched_pairs=pairs)
    base = prompt(4 * PS, 7)
    engine.add_request(base + [1], ONE)
    run_steps(engine)  # the shared 4 blocks are device-cached
    length = 16 * PS
    cold = engine.add_request(prompt(length, 99), ONE)
    stream_steps = 40
    counter = iter(range(10**6))

    def feed(step):  # two requests a step, 48 uncached tokens each: more than the budget
        if step < stream_steps:
            for _ in range(2):
                engine.add_request(base + prompt(48, 1000 + next(counter)), ONE)

    first = run_steps(engine, on_step=feed)
    bound = max_passes + 2 + math.ceil(length / (BUDGET // 2))
    if pairs is not None:
        assert pairs > length
        bound += math.ceil(length * (length + 1) / 2 / (pairs - length))
    assert first[cold] <= bound, (first[cold], bound)
    assert max(first.values()) >= stream_steps  # the stream really outlasted the bound


@pytest.mark.parametrize("policy", ["cache-aware", "fcfs"])
def test_request_waiting_for_pages_for_its_loads_does_not_stop_the_ones_behind_it(policy):
    b = prompt(N, 2)
    llm = host_cached(b, schedule_policy=policy, llm=StandInLLM)  # 10 device pages; b's 8 blocks in the host tier
    engine, sched = llm.engine, llm.engine.scheduler
    engine.add_request(prompt(5 * PS, 3), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.step()  # it holds 5, then 6 pages while it decodes
    blocked = engine.add_request(b, ONE)
    behind = engine.add_request(prompt(2 * PS, 5), ONE)  # 2 pages: fits now
    outs = engine.step()  # b's 8 loads do not fit in the pages left
    seq = next(s for s in sched.waiting if s.seq_id == blocked)
    assert not seq.page_ids and seq not in sched.loading
    if policy == "cache-aware":
        assert [o.request_id for o in outs] == [behind]
    else:
        assert outs == [] and any(s.seq_id == behind for s in sched.waiting)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    assert done[blocked].num_cached_tokens == 8 * PS  # it still loads its whole prefix later
    assert done[blocked].cached_tokens_by_tier["host"] > 0


def test_schedule_policy_is_validated():
    with pytest.raises(ValueError, match=r"schedule_policy must be one of \('cache-aware', 'fcfs'\), got 'lifo'"):
        LLM("tiny", num_device_pages=16, schedule_policy="lifo")
    with pytest.raises(ValueError, match="schedule_max_passes must be an int >= 1, got 0"):
        LLM("tiny", num_device_pages=16, schedule_max_passes=0)


@pytest.mark.parametrize("policy", ["cache-aware", "fcfs"])
def test_cached_request_blocked_on_pages_preempts_a_costlier_running_prefill(policy):
    """38 device pages: a 36-page cold prefill soon leaves too few for a 13-page request whose
    blocks are cached; cache-aware admission preempts the prefill (its computed blocks stay
    cached and are loaded back) and lets the cached request in; both produce what they produce
    alone."""
    llm = always_load(StandInLLM("tiny", page_size=PS, num_device_pages=38, max_num_batched_tokens=BUDGET,
                          max_num_batched_pairs=NO_PAIR_CAP, host_cache_bytes=64 * 15360, schedule_policy=policy))
    engine = llm.engine
    engine.pool.tiers.cost_model.alpha = 0.0  # 1 token/s whatever steps take: costs, not timing, set the rank
    short, cold_prompt, alone, cold, rid = _cold_prefill_then_cached_turn(llm)
    first, outs, step = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        for seq in engine.scheduler.running:
            if seq.output_token_ids:
                first.setdefault(seq.seq_id, step)
        for i in outs:
            first.setdefault(i, step)
        step += 1
    assert outs[rid].token_ids == alone[tuple(short)] and outs[cold].token_ids == alone[tuple(cold_prompt)]
    assert outs[rid].num_cached_tokens == 12 * PS
    # the preemption is the cold prefill's, before its first token, and counted on it
    assert outs[cold].metrics.num_preemptions == engine.scheduler.num_preemptions
    assert outs[rid].metrics.num_preemptions == outs[cold].metrics.preemptions_after_first_token == 0
    if policy == "cache-aware":
        assert first[rid] < first[cold] and engine.scheduler.num_preemptions == 1
    else:  # it waits for the whole prefill
        assert first[rid] >= first[cold] and engine.scheduler.num_preemptions == 0


NO_PAIR_CAP = 10**9
"""A step attention budget no chunk here reaches: the scenarios below are laid out in whole
token-budget chunks."""


def _cold_prefill_then_cached_turn(llm):
    """On a 38-page pool (no attention cap: whole ``BUDGET`` chunks): a short prompt runs (its
    blocks reach the host tier), then a 36-page cold
    prompt prefills for 6 steps (24 pages; its next chunk leaves 10 free), then the short prompt
    returns. Returns (the short prompt, the cold prompt, outputs of each alone, cold id, short id)."""
    engine = llm.engine
    short, cold_prompt = prompt(12 * PS + 1, 10), prompt(36 * PS, 99)
    plain = alone_engine()
    alone = {tuple(p): plain.generate(prompt_token_ids=[p], sampling_params=TWO)[0].token_ids for p in (short, cold_prompt)}
    llm.generate(prompt_token_ids=[short], sampling_params=TWO)
    engine.pool.poll(wait=True)  # write-through copies ended: its blocks are in the host tier
    cold = engine.add_request(cold_prompt, TWO)
    for _ in range(6):
        engine.step()
    return short, cold_prompt, alone, cold, engine.add_request(short, TWO)


def _first_and_outputs(engine):
    """Step until idle: ``({request_id: step of its first token}, {request_id: output})``."""
    first, outs, step = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
            first.setdefault(out.request_id, step)
        for seq in engine.scheduler.running:
            if seq.output_token_ids:
                first.setdefault(seq.seq_id, step)
        step += 1
        assert step < 500, "did not finish"
    return first, outs


@pytest.mark.parametrize("case", ["cache-aware", "fcfs", "no-lower-tier"])
def test_cached_turn_blocked_by_a_decode_preempts_it_when_its_blocks_load_back(case, monkeypatch):
    """10 device pages: a decode holding 6 leaves too few for a new turn whose 8 blocks are in
    the host tier. Cache-aware admission preempts the decode (its first token is out, and its
    blocks are kept below the device, so it resumes by loading them) and the cached turn gets
    its first token before the decode's last; under FCFS, or when the pool would lose the
    decode's blocks (no lower tier: resuming would mean recomputing them), it waits. Every
    output is what the request produces alone."""
    b = prompt(N, 2)
    llm = host_cached(b, schedule_policy="fcfs" if case == "fcfs" else "cache-aware", llm=StandInLLM)
    engine = llm.engine
    if case == "no-lower-tier":
        monkeypatch.setattr(type(engine.pool), "keeps_evicted_blocks", property(lambda self: False))
    long_decode = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    decode_prompt = prompt(5 * PS, 3)
    dec = engine.add_request(decode_prompt, long_decode)
    engine.step()  # it holds 5, then 6 pages while it decodes
    rid = engine.add_request(b, TWO)
    first, outs = _first_and_outputs(engine)
    plain = alone_engine()
    assert outs[rid].token_ids == plain.generate(prompt_token_ids=[b], sampling_params=TWO)[0].token_ids
    assert outs[dec].token_ids == plain.generate(prompt_token_ids=[decode_prompt], sampling_params=long_decode)[0].token_ids
    assert outs[rid].num_cached_tokens == 8 * PS and outs[rid].cached_tokens_by_tier["host"] > 0
    finished = {i: s for s, i in enumerate(sorted(outs, key=lambda i: outs[i].metrics.finish_time))}
    # the decode is preempted after its first token: its TTFT was made, and that count says so
    assert outs[dec].metrics.preemptions_after_first_token == engine.scheduler.num_preemptions
    assert outs[dec].metrics.num_preemptions == 0
    if case == "cache-aware":
        assert engine.scheduler.num_preemptions == 1
        assert finished[rid] < finished[dec] and first[rid] < first[dec] + 11
    else:
        assert engine.scheduler.num_preemptions == 0
        assert outs[rid].metrics.first_token_time > outs[dec].metrics.finish_time


@pytest.mark.parametrize("case", ["cache-aware", "fcfs", "no-lower-tier"])
def test_new_cold_turn_blocked_by_a_decode_preempts_it_when_its_blocks_load_back(case, monkeypatch):
    """Nothing of the new turn is cached: its first token still goes before another request's
    next tokens (that request's TTFT is made, and its blocks come back from the host tier), so
    a decode holding the pages it needs is preempted; under FCFS, or when the pool would lose
    the decode's blocks, the turn waits for the decode to end. Outputs are unchanged."""
    llm = host_cached(schedule_policy="fcfs" if case == "fcfs" else "cache-aware", llm=StandInLLM)
    engine = llm.engine
    if case == "no-lower-tier":
        monkeypatch.setattr(type(engine.pool), "keeps_evicted_blocks", property(lambda self: False))
    long_decode = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    decode_prompt, cold_prompt = prompt(5 * PS, 3), prompt(N, 77)
    dec = engine.add_request(decode_prompt, long_decode)
    engine.step()  # it holds 5, then 6 pages while it decodes: the cold turn's 9 do not fit
    rid = engine.add_request(cold_prompt, TWO)
    first, outs = _first_and_outputs(engine)
    plain = alone_engine()
    assert outs[rid].token_ids == plain.generate(prompt_token_ids=[cold_prompt], sampling_params=TWO)[0].token_ids
    assert outs[dec].token_ids == plain.generate(prompt_token_ids=[decode_prompt], sampling_params=long_decode)[0].token_ids
    assert outs[rid].num_cached_tokens == 0
    if case == "cache-aware":
        assert outs[dec].metrics.preemptions_after_first_token == engine.scheduler.num_preemptions == 1
        assert outs[rid].metrics.first_token_time < outs[dec].metrics.finish_time
    else:
        assert engine.scheduler.num_preemptions == 0
        assert outs[rid].metrics.first_token_time > outs[dec].metrics.finish_time


@pytest.mark.parametrize("max_passes", [1, 2, 16])
def test_a_decode_is_displaced_by_new_turns_fewer_than_its_aging_bound(max_passes):
    """Bound: each preemption counts as a step passed over, and a sequence is not preempted for
    others when that would age it; past its first token that is at
    ``DECODE_AGE_FACTOR * schedule_max_passes`` steps (then it ranks first). Four cached turns,
    each arriving while the decode runs and needing its pages, preempt it once each when the
    bound allows (2 and 16); with 1 the bound stops the fourth. It still produces
    all its tokens."""
    turns = [prompt(N, 20 + i) for i in range(DECODE_AGE_FACTOR)]
    llm = host_cached(*turns, llm=StandInLLM)
    engine, sched = llm.engine, llm.engine.scheduler
    reconfigure(sched, schedule_max_passes=max_passes)
    long_decode = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    decode_prompt = prompt(5 * PS, 3)
    dec = engine.add_request(decode_prompt, long_decode)
    outs, steps = {}, 0
    for t in turns:
        while dec not in outs and not any(s.seq_id == dec and s.output_token_ids for s in sched.running):
            outs.update({o.request_id: o for o in engine.step()})
            steps += 1
            assert steps < 500
        rid = engine.add_request(t, TWO)
        while rid not in outs:
            outs.update({o.request_id: o for o in engine.step()})
            steps += 1
            assert steps < 500
        assert outs[rid].num_cached_tokens == 8 * PS
    outs.update(_first_and_outputs(engine)[1])
    assert 0 < sched.num_preemptions < DECODE_AGE_FACTOR * max_passes
    assert outs[dec].metrics.preemptions_after_first_token == sched.num_preemptions
    if max_passes > 1:
        assert sched.num_preemptions == len(turns)
    else:
        assert sched.num_preemptions < len(turns)
    plain = alone_engine()
    assert outs[dec].token_ids == plain.generate(prompt_token_ids=[decode_prompt], sampling_params=long_decode)[0].token_ids


@pytest.mark.parametrize("lower_tier", [True, False])
def test_cached_turn_preempts_a_cold_prefill_that_ranks_ahead_when_its_blocks_load_back(lower_tier, monkeypatch):
    """The cold prefill arrived long before the cached turn (its deadline is earlier), and its
    pages leave too few for the turn's loads. With a lower tier keeping evicted blocks the turn
    preempts it (its computed blocks load back) and gets its first token before the prefill
    ends; without one it waits for the prefill. Outputs are those of each request alone."""
    llm = always_load(StandInLLM("tiny", page_size=PS, num_device_pages=38, max_num_batched_tokens=BUDGET,
                          max_num_batched_pairs=NO_PAIR_CAP, host_cache_bytes=64 * 15360))
    engine = llm.engine
    if not lower_tier:
        monkeypatch.setattr(type(engine.pool), "keeps_evicted_blocks", property(lambda self: False))
    short, cold_prompt, alone, cold, rid = _cold_prefill_then_cached_turn(llm)
    engine.sequence(rid).metrics.arrival_time += 1e6  # arrived long after the cold prefill's deadline
    first, outs = _first_and_outputs(engine)
    assert outs[rid].token_ids == alone[tuple(short)] and outs[cold].token_ids == alone[tuple(cold_prompt)]
    assert outs[rid].num_cached_tokens == 12 * PS
    if lower_tier:  # once: it is not re-admitted (taking back the pages) while the turn loads
        assert first[rid] < first[cold] and engine.scheduler.num_preemptions == 1
    else:
        assert first[rid] >= first[cold] and engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("policy", ["cache-aware", "fcfs"])
def test_a_shorter_prompt_chunks_beside_a_long_cold_one_but_never_a_third(policy):
    """A 512-token cold prompt is being chunked when a 192-token and then a 160-token one arrive
    (64-token budget: neither fits in a step). Cache-aware ranks both ahead of the long one; the
    cheaper starts chunking beside it at once, the other waits until that one ends (two chunked
    prefills at most), then chunks beside the long one in turn: first tokens come shortest
    first. FCFS serves them in arrival order. Outputs equal each request run alone."""
    engine = engine_for(policy)
    engine.pool.tiers.cost_model.alpha = 0.0  # 1,000 tokens/s whatever steps take: costs set the rank
    prompts = [prompt(512, 41), prompt(192, 42), prompt(160, 43)]
    long_id = engine.add_request(prompts[0], ONE, arrival_time=0.0)
    engine.step()
    engine.step()
    mid_id = engine.add_request(prompts[1], ONE, arrival_time=0.01)
    short_id = engine.add_request(prompts[2], ONE, arrival_time=0.02)
    chunking, outs = [], {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
        chunking.append({s.seq_id for s in engine.scheduler.running if s.num_computed_tokens < s.num_tokens - 1})
    assert max(len(c) for c in chunking) <= 2
    first = {i: outs[i].metrics.first_token_time for i in outs}
    if policy == "cache-aware":
        assert {long_id, short_id} in chunking and {long_id, mid_id} in chunking
        assert first[short_id] < first[mid_id] < first[long_id]
    else:
        assert first[long_id] < first[mid_id] < first[short_id]
    plain = alone_engine(256)
    for i, p in zip((long_id, mid_id, short_id), prompts):
        assert outs[i].token_ids == plain.generate(prompt_token_ids=[p], sampling_params=ONE)[0].token_ids


@pytest.mark.parametrize("tokens, overtakes", [(10 * PS, False), (3 * PS, False), (10 * PS, True)],
                         ids=["longer-than-a-step", "longer-than-the-step-leaves", "overtakes"])
def test_a_request_that_waits_behind_the_chunked_prefill_preempts_nobody(tokens, overtakes):
    """A decode runs while a 256-token cold prompt is chunked (64-token budget); a cold turn
    that arrived after it failed admission on pages (2 free, its first chunk needs 3-4). When
    it ranks behind the chunked prompt it will wait for that one to end whatever pages are
    freed, so making room for it preempts nobody (the decode would only wait for it while it
    waits): a 160-token turn does not fit in a step; a 48-token one does not fit in what the
    step leaves admission (64 less the decode's token and the chunked prompt's 32). When it
    ranks ahead (a slower token rate makes the chunked prompt's 193 tokens left cost more than
    its 160), running sequences are preempted for it (here the chunked prompt and the decode;
    their blocks load back from the host tier)."""
    llm = always_load(StandInLLM("tiny", page_size=PS, num_device_pages=24, host_cache_bytes=64 * BLOCK,
                          max_num_batched_tokens=BUDGET, max_num_batched_pairs=10**9))
    engine, scheduler = llm.engine, llm.engine.scheduler
    cm = engine.pool.tiers.cost_model
    cm.alpha, cm.prefill_tok_s = 0.0, 1.0 if overtakes else 1000.0
    long_decode = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    decode = engine.add_request(prompt(4 * PS, 61), long_decode, arrival_time=0.0)
    engine.step()
    chunked = engine.add_request(prompt(16 * PS, 62), TWO, arrival_time=0.1)
    engine.step()
    new = engine.add_request(prompt(tokens, 63), TWO, arrival_time=0.2 if overtakes else 5.0)
    new_seq = engine.sequence(new)
    assert engine.sequence(chunked).num_computed_tokens == BUDGET - 1 and engine.sequence(decode).output_token_ids
    occupy(engine.pool, engine.pool.num_free_pages - 2)
    scheduler.queues.block(new_seq, engine.pool.num_free_pages, 0)  # it failed admission on pages
    ranking = scheduler.ranking
    assert (ranking.key(new_seq) < ranking.key(engine.sequence(chunked))) is overtakes
    assert ranking.waits_for_chunk(new_seq, scheduler.plan.budget) is not overtakes
    made = scheduler.preemption.make_room(scheduler.plan.budget)
    assert (made is not None) is overtakes
    if overtakes:
        assert made[0] is new_seq and {s.seq_id for s in made[1]} == {decode, chunked}


def test_a_request_preempted_before_its_first_token_preempts_a_decode_to_get_back_in():
    """As a new turn does (above), a request that was admitted and preempted before its first
    token (its TTFT still runs) preempts a decode holding the pages it needs, whose blocks load
    back from the host tier, instead of waiting for the decode to end. Outputs are unchanged."""
    llm = host_cached(llm=StandInLLM)
    engine = llm.engine
    long_decode = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    decode_prompt, cold_prompt = prompt(5 * PS, 3), prompt(N, 78)
    dec = engine.add_request(decode_prompt, long_decode)
    engine.step()  # it holds 5, then 6 pages while it decodes: the other request's 9 do not fit
    rid = engine.add_request(cold_prompt, TWO)
    engine.sequence(rid).admitted = True  # as a request preempted before its first token is
    first, outs = _first_and_outputs(engine)
    plain = alone_engine()
    assert outs[rid].token_ids == plain.generate(prompt_token_ids=[cold_prompt], sampling_params=TWO)[0].token_ids
    assert outs[dec].token_ids == plain.generate(prompt_token_ids=[decode_prompt], sampling_params=long_decode)[0].token_ids
    assert outs[dec].metrics.preemptions_after_first_token == engine.scheduler.num_preemptions == 1
    assert outs[rid].metrics.first_token_time < outs[dec].metrics.finish_time


def test_an_aged_request_past_its_first_token_preempts_a_decode_to_get_back_in():
    """A request preempted after its first token that has aged ranks first; when its blocks do
    not fit beside a running decode, it preempts the decode (whose blocks load back) rather than
    hold admission for everyone until the decode ends. Outputs are each request's alone."""
    llm = host_cached(llm=StandInLLM)
    engine, scheduler = llm.engine, llm.engine.scheduler
    long_decode = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    aged_prompt, decode_prompt = prompt(N, 81), prompt(5 * PS, 82)
    aged = engine.add_request(aged_prompt, long_decode)
    engine.step()
    aged_seq = engine.sequence(aged)
    assert aged_seq.output_token_ids and aged_seq in scheduler.running
    scheduler.queues.preempt(aged_seq, engine.pool)  # as a new turn displacing it would
    engine.pool.poll(wait=True)  # its blocks reach the host tier
    dec = engine.add_request(decode_prompt, long_decode)
    engine.step()  # the decode holds 6 of the 10 pages: the aged request's 9 do not fit
    assert engine.sequence(dec).output_token_ids and aged_seq.status.name == "WAITING"
    aged_seq.num_passed_over = scheduler.ranking.age_limit(aged_seq)
    assert scheduler.ranking.urgent(aged_seq)
    first, outs = _first_and_outputs(engine)
    plain = alone_engine()
    for rid, p in ((aged, aged_prompt), (dec, decode_prompt)):
        assert outs[rid].token_ids == plain.generate(prompt_token_ids=[p], sampling_params=long_decode)[0].token_ids
    assert outs[dec].metrics.preemptions_after_first_token == 1
    assert outs[aged].metrics.finish_time < outs[dec].metrics.finish_time


@pytest.mark.parametrize("policy", ["cache-aware", "fcfs"])
def test_cached_turn_is_admitted_in_its_first_step_when_earlier_cold_prompts_fill_the_budget(policy):
    """The fast lane (FAST_LANE_SHARE of the budget): cold prompts that arrived well before it
    rank ahead of a returning turn by deadline and fill the step's budget; the returning turn,
    one token to prefill after its cached blocks, still gets its first token in that step."""
    engine = engine_for(policy)
    short = prompt(4 * PS + 1, 10)
    engine.add_request(short, ONE)
    run_steps(engine)  # its 4 full blocks are device-cached
    assert math.floor(BUDGET * FAST_LANE_SHARE) >= 1
    earlier = engine.clock() - 10.0  # their deadlines are earlier whatever their cost
    colds = [engine.add_request(prompt(PS, 50 + i), ONE, arrival_time=earlier) for i in range(BUDGET // PS + 1)]
    cached = engine.add_request(short, ONE)
    first = run_steps(engine)
    assert set(colds) <= first.keys()  # every one got its token
    if policy == "cache-aware":
        assert first[cached] == 0, first
        assert sum(first[rid] == 0 for rid in colds) == BUDGET // PS - 1  # one cold prompt's worth gave way
    else:  # FCFS: the earlier cold prompts take the whole first step
        assert first[cached] > 0, first


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "no-lane"])
def test_cached_turn_gets_its_first_token_beside_two_running_prefills_that_fill_the_budget(lane, monkeypatch):
    """Two cold prefills that arrived earlier run in chunks and would take the whole budget (the
    chunked one its ``CHUNK_SHARE``, the one ranked ahead of it the rest); the fast lane's share
    is planned off them, so a returning turn that arrives now still runs in its first step."""
    if not lane:
        monkeypatch.setattr("kvtier.serve.ranking.FAST_LANE_SHARE", 0.0)
    engine = engine_for("cache-aware")
    short = prompt(4 * PS + 1, 10)
    engine.add_request(short, ONE)
    run_steps(engine)  # its 4 full blocks are device-cached
    earlier = engine.clock() - 10.0
    engine.add_request(prompt(20 * PS, 99), ONE, arrival_time=earlier)  # chunked
    engine.step()
    beside = engine.add_request(prompt(8 * PS, 98), ONE, arrival_time=earlier - 1.0)  # ranks ahead: chunks beside
    engine.step()
    assert any(s.seq_id == beside and s.num_computed_tokens > 0 for s in engine.scheduler.running)
    cached = engine.add_request(short, ONE)
    finished = {o.request_id: o for o in engine.step()}  # ONE: a request finishes with its first token
    assert (cached in finished) == lane, finished
    assert all(o.error is None for o in finished.values())
