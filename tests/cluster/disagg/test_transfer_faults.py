"""A transfer cut in the middle, a decode worker that hangs and one that is gone: the prefill
worker answers at once with the loss counted, and the decode worker's output is still correct
(it recomputes what did not arrive)."""

import httpx

from tests.cluster.disagg.helpers import PAGE_SIZE, assert_same_output, metric, turn

HEADER_BYTES = 64


def _prefill(prefill_url: str, decode_url: str, messages: list[dict], session: str) -> dict:
    r = httpx.post(f"{prefill_url}/v1/kv/prefill/chat/completions", timeout=120,
                   headers={"x-kvtier-decode-url": decode_url, "x-session-id": session},
                   json={"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0.0,
                         "logprobs": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["transfer"]


def _conversation(tag: str) -> list[dict]:
    text = " ".join(f"{tag} note {i}: the cache keeps what the agent read." for i in range(20))
    return [{"role": "system", "content": text}, {"role": "user", "content": f"Summarise the {tag} notes."}]


def test_cut_transfer_ends_in_correct_output(pd):
    decode, prefill, proxy = pd["decode"], pd["prefill"], pd["proxy"]
    messages = _conversation("cut")
    stored = metric(decode, "kvtier_kv_import_blocks_total", result="stored")
    truncated = metric(decode, "kvtier_kv_import_blocks_total", result="truncated")
    value_bytes = HEADER_BYTES + httpx.get(f"{decode.url}/v1/kv/info", timeout=10).json()["layouts"]["blocks"]["payload_bytes"]
    proxy.cut_next(400 + value_bytes + value_bytes // 2)  # request line and headers, one value, half the next
    report = _prefill(prefill.url, proxy.url, messages, "cut-session")
    assert proxy.cuts == 1
    assert report["failed"] and report["blocks_held"] == 0 and report["blocks_needed"] > 2
    assert report["blocks_stored"] == 0  # the batch was never acknowledged
    assert report["blocks_lost"] == report["blocks_needed"]
    got, _ = turn(decode.url, messages, "cut-session")
    want, _ = turn(pd["colocated"].url, messages, "cut-colocated")
    assert_same_output(got, want)
    # The one value complete before the cut was registered and used; the cut one was not.
    assert metric(decode, "kvtier_kv_import_blocks_total", result="stored") - stored == 1
    assert metric(decode, "kvtier_kv_import_blocks_total", result="truncated") - truncated == 1
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == PAGE_SIZE


def test_hung_decode_worker_does_not_stall_prefill(pd):
    decode, prefill, proxy = pd["decode"], pd["prefill"], pd["proxy"]
    messages = _conversation("hang")
    proxy.freeze_next()
    report = _prefill(prefill.url, proxy.url, messages, "hang-session")
    assert report["failed"] and "Timeout" in report["error"]
    assert report["blocks_stored"] == 0 and report["blocks_lost"] == report["blocks_needed"]
    # The prefill worker goes on serving, and the decode worker recomputes the whole prompt.
    again = _prefill(prefill.url, decode.url, _conversation("after-hang"), "after-hang")
    assert not again["failed"] and again["blocks_stored"] == again["blocks_needed"]
    got, _ = turn(decode.url, messages, "hang-session")
    want, _ = turn(pd["colocated"].url, messages, "hang-colocated")
    assert_same_output(got, want)


def test_gone_decode_worker_fails_the_transfer_not_the_prefill(pd):
    report = _prefill(pd["prefill"].url, pd["dead"], _conversation("gone"), "gone-session")
    assert report["failed"] and report["blocks_held"] == -1 and report["blocks_sent"] == 0
    assert report["blocks_lost"] == report["blocks_needed"] > 0
