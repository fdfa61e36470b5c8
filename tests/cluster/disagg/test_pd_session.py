"""A multi-turn session through a prefill and a decode worker (behind the P/D router) gives the
outputs of one colocated worker, and each turn sends exactly the blocks the decode worker lacked."""

import httpx

from tests.cluster.disagg.helpers import PAGE_SIZE, assert_same_output, metric, turn

SYSTEM = " ".join(f"rule {i}: keep the diff small and run the tests." for i in range(24))


def test_session_matches_colocated_and_sends_only_missing_blocks(pd, router):
    decode, prefill, colocated = pd["decode"], pd["prefill"], pd["colocated"]
    stored_before = metric(decode, "kvtier_kv_import_blocks_total", result="stored")
    duplicates_before = metric(decode, "kvtier_kv_import_blocks_total", result="duplicate")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    sent_total, previous_needed = 0, None
    for k in range(3):
        want, _ = turn(colocated.url, messages, "colocated-session")
        got, report = turn(router, messages, "pd-session")
        assert_same_output(got, want)
        prompt_tokens = got["usage"]["prompt_tokens"]
        needed = (prompt_tokens - 1) // PAGE_SIZE  # reusable full blocks (the last token is always computed)
        assert report is not None and not report["failed"], report
        assert report["blocks_needed"] == needed
        if previous_needed is None:
            assert report["blocks_held"] == 0  # a fresh decode worker
        else:
            assert report["blocks_held"] >= previous_needed  # it kept at least the last prompt's blocks
        assert report["blocks_sent"] == needed - report["blocks_held"]
        assert report["blocks_stored"] == report["blocks_sent"] and report["blocks_lost"] == 0
        value_bytes = report["full_prompt_bytes"] // needed
        assert report["bytes_sent"] == report["blocks_sent"] * value_bytes
        # The decode worker computed only the prompt's tail: every reusable block was there.
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == needed * PAGE_SIZE
        sent_total += report["blocks_sent"]
        previous_needed = needed
        messages += [{"role": "assistant", "content": got["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Now step {k}: explain what you changed and why."}]
    # Every block sent was one the decode worker lacked (none arrived as a duplicate), and each was stored.
    assert metric(decode, "kvtier_kv_import_blocks_total", result="stored") - stored_before == sent_total
    assert metric(decode, "kvtier_kv_import_blocks_total", result="duplicate") == duplicates_before
    assert metric(prefill, "kvtier_kv_transfer_bytes_total") > 0
    for server, role in ((prefill, "prefill"), (decode, "decode")):
        assert metric(server, "kvtier_worker_role", role=role) == 1
        assert metric(server, "kvtier_engine_busy_seconds_total") > 0
    health = httpx.get(f"{router}/health", timeout=10).json()
    assert health["pd"]["turns"] >= 3 and health["pd"]["fallbacks"] == 0


def test_streamed_turn_carries_the_transfer_report(pd, router):
    import json

    messages = [{"role": "system", "content": SYSTEM + " Streamed."}, {"role": "user", "content": "Go."}]
    with httpx.stream("POST", f"{router}/v1/chat/completions", timeout=300,
                      json={"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0.0,
                            "stream": True}) as r:
        assert r.status_code == 200
        report = json.loads(r.headers["x-kvtier-transfer"])
        body = r.read().decode()
    assert body.rstrip().endswith("data: [DONE]")
    assert report["blocks_sent"] == report["blocks_needed"] - report["blocks_held"] > 0


def test_bad_request_through_the_router_gets_its_error_not_silence(router):
    before = httpx.get(f"{router}/health", timeout=10).json()["pd"]["refused"]
    r = httpx.post(f"{router}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert httpx.get(f"{router}/health", timeout=10).json()["pd"]["refused"] == before + 1
