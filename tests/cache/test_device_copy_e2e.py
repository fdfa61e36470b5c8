"""The GPU copy path through the engine: outputs with hits from each tier equal outputs with
caching disabled (fp32 logprobs within 1e-4), and a request's forward waits for its load while
other requests keep running. On CPU the pool's copy engine is a
:class:`kvtier.cache.device_copy.DeviceCopyEngine` on :class:`kvtier.cache.streams.CpuStreams`;
on a GPU (tests marked ``gpu``) the pool picks it with CUDA/HIP streams by itself."""

import dataclasses
import functools

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.cache.device_copy import DeviceCopyEngine
from kvtier.cache.streams import CpuStreams, CudaStreams
from kvtier.serve import admission
from tests.helpers.serving import PS, always_load, prompt
from tests.helpers.tiers import HOST_BYTES, PARAMS, assert_matches, flush_device, warm

GPU_PARAM = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")])


def reference(p, device):
    return _reference(tuple(p), device)


@functools.cache
def _reference(p, device):
    llm = LLM("tiny", device=device, dtype="float32", page_size=PS, num_device_pages=64, enable_prefix_caching=False)
    return llm.generate(prompt_token_ids=[list(p)], sampling_params=PARAMS)[0]


@pytest.fixture(scope="module")
def prompts():
    first = prompt(200, 21)
    return first, first[:170] + prompt(30, 22)


def device_path(llm, device, deferred=False):
    """The engine's pool with the device copy path: on CPU swapped in (deferred or synchronous
    CPU streams), on a GPU the one the pool chose."""
    pool = llm.engine.pool
    if device == "cpu":
        pool.tiers.copy_engine = DeviceCopyEngine("cpu", CpuStreams(deferred=deferred))
    assert isinstance(pool.tiers.copy_engine, DeviceCopyEngine)
    assert isinstance(pool.tiers.copy_engine.streams, CpuStreams if device == "cpu" else CudaStreams)
    return llm


@pytest.mark.parametrize("device", ["cpu", GPU_PARAM])
@pytest.mark.parametrize("tier,deferred", [("device", False), ("host", False), ("host", True), ("disk", False),
                                           ("disk", True)])
def test_hits_from_each_tier_equal_recomputation(prompts, tier, deferred, device, tmp_path):
    if device != "cpu" and deferred:
        pytest.skip("deferred CPU streams are a CPU-only mode")
    first, second = prompts
    args = dict(device=device, dtype="float32", page_size=PS, num_device_pages=17, host_cache_bytes=64 << 20)
    if tier == "disk":
        args.update(host_cache_bytes=HOST_BYTES, disk_cache_dir=str(tmp_path), disk_cache_bytes=64 << 20)
    llm = device_path(always_load(LLM("tiny", **args)), device, deferred)
    if tier == "device":
        llm.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    else:
        warm(llm, first)
    out = llm.generate(prompt_token_ids=[second], sampling_params=PARAMS)[0]
    assert out.cached_tokens_by_tier.get(tier, 0) > 0
    assert_matches(out, reference(second, device), min_hit=PS)
    llm.engine.pool.poll(wait=True)
    assert llm.engine.pool.stats().copy_errors == 0


def test_a_forward_waits_for_its_load_while_others_run(prompts, monkeypatch):
    no_inline = dataclasses.replace(admission.CACHE_AWARE, inline_share=0.0)  # every load runs beside the steps
    monkeypatch.setitem(admission.POLICIES, "cache-aware", no_inline)
    first, second = prompts
    llm = device_path(always_load(LLM("tiny", page_size=PS, num_device_pages=17, host_cache_bytes=64 << 20)),
                      "cpu", deferred=True)
    engine, streams = llm.engine, llm.engine.pool.tiers.copy_engine.streams
    llm.generate(prompt_token_ids=[first], sampling_params=PARAMS)
    engine.pool.poll(wait=True)
    flush_device(llm)
    engine.pool.poll(wait=True)
    run = engine.runner.run

    def logged_run(batch):
        streams.log.append(("forward", frozenset(s.seq_id for s in [*(s for s, _ in batch.extends), *batch.decodes])))
        return run(batch)

    engine.runner.run = logged_run
    other = engine.add_request(prompt(40, 23), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    rid = engine.add_request(second, PARAMS)
    engine.step()
    # a prefix's host blocks load in one job; each block's handle is its part of that job
    loads = {b.handle.job._span.seq for b in engine.sequence(rid).kv.loads if b.handle is not None}
    assert loads and rid in {s.seq_id for s in engine.scheduler.loading}
    assert streams.log[-1] == ("forward", frozenset({other}))  # the other request ran; the load waits
    assert not any(entry == ("copy", seq) for seq in loads for entry in streams.log)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    forward = next(i for i, e in enumerate(streams.log) if e[0] == "forward" and rid in e[1])
    for seq in loads:
        assert streams.log.index(("copy", seq)) < streams.log.index(("compute_wait", seq)) < forward
    assert outs[rid].cached_tokens_by_tier["host"] > 0
    assert_matches(outs[rid], reference(second, "cpu"), min_hit=PS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_a_forward_waits_for_its_load_on_the_gpu(prompts, monkeypatch):
    no_inline = dataclasses.replace(admission.CACHE_AWARE, inline_share=0.0)  # every load runs beside the steps
    monkeypatch.setitem(admission.POLICIES, "cache-aware", no_inline)
    first, second = prompts
    llm = device_path(always_load(LLM("tiny", device="cuda", dtype="float32", page_size=PS, num_device_pages=17,
                                      host_cache_bytes=64 << 20)), "cuda")
    engine, streams = llm.engine, llm.engine.pool.tiers.copy_engine.streams
    warm(llm, first)
    log, wait, run = [], streams.compute_wait, engine.runner.run

    def logged_wait(span):
        log.append("compute_wait")
        wait(span)

    def logged_run(batch):
        log.append({s.seq_id for s, _ in batch.extends} | {s.seq_id for s in batch.decodes})
        return run(batch)

    streams.compute_wait, engine.runner.run = logged_wait, logged_run
    torch.cuda._sleep(int(2e8))  # the loads wait behind running compute work
    rid = engine.add_request(second, PARAMS)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    forward = next(i for i, e in enumerate(log) if isinstance(e, set) and rid in e)
    assert "compute_wait" in log[:forward]
    assert outs[rid].cached_tokens_by_tier["host"] > 0
    assert_matches(outs[rid], reference(second, "cuda"), min_hit=PS)
