"""A hybrid KDA + MLA model (``tiny-k3``) through a prefill and a decode worker: the prefill worker
sends the prompt's reusable blocks and the state checkpoint after the last of them, so the decode
worker reuses the prefix exactly and its output equals a colocated worker's."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import TOKENIZER_DIR
from tests.cluster.disagg.helpers import PAGE_SIZE, assert_same_output, turn
from tests.serve.api.conftest import start_listening, start_server, stop_server

ARGS = ("--dtype", "float32", "--page-size", str(PAGE_SIZE), "--num-device-pages", "256",
        "--max-num-batched-tokens", "64", "--max-num-seqs", "4")
SYSTEM = " ".join(f"rule {i}: keep the diff small and run the tests." for i in range(12))


@pytest.fixture(scope="module")
def hybrid_pd(tmp_path_factory):
    started, proc = {}, None
    try:
        started["colocated"] = start_server(tmp_path_factory.mktemp("k3-colocated"), *ARGS, model="tiny-k3")
        started["decode"] = start_server(tmp_path_factory.mktemp("k3-decode"), *ARGS, "--role", "decode",
                                         model="tiny-k3")
        started["prefill"] = start_server(tmp_path_factory.mktemp("k3-prefill"), *ARGS, "--role", "prefill",
                                          "--decode-workers", started["decode"].url, model="tiny-k3")
        log = tmp_path_factory.mktemp("k3-router") / "router.log"
        proc, url = start_listening(["router", "--prefill-workers", started["prefill"].url, "--decode-workers",
                                     started["decode"].url, "--port", "0"], log, timeout_s=60)
        assert url, log.read_text(errors="replace")
        yield {**started, "router": url}
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(20)
        for s in started.values():
            stop_server(s)
    for name, s in started.items():
        text = s.log.read_text(errors="replace")
        assert "Traceback" not in text, f"{name}: {text[-3000:]}"


def test_hybrid_turns_through_pd_reuse_the_sent_blocks_and_state_exactly(hybrid_pd):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    for k in range(2):
        want, _ = turn(hybrid_pd["colocated"].url, messages, "colocated", model="tiny-k3")
        got, report = turn(hybrid_pd["router"], messages, "pd", model="tiny-k3")
        assert_same_output(got, want)
        needed = (got["usage"]["prompt_tokens"] - 1) // PAGE_SIZE
        assert report is not None and not report["failed"], report
        assert report["values_sent"] == {"states": 1} and report["values_stored"] == {"states": 1}, report
        # The decode worker placed every reusable block with the state after the last one.
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == needed * PAGE_SIZE
        messages += [{"role": "assistant", "content": got["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Now step {k}: explain what you changed."}]


def test_k3_prompt_fields_reach_the_prefill_worker(hybrid_pd):
    """A response_format tail and thinking off shape K3's prompt: the prefill worker renders the same
    prompt the decode worker does, so the decode worker reuses every block it was sent."""
    fields = {"response_format": {"type": "json_object"}, "thinking": {"type": "disabled"}}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Answer in JSON."}]
    want, _ = turn(hybrid_pd["colocated"].url, messages, "colocated-fields", model="tiny-k3", **fields)
    got, report = turn(hybrid_pd["router"], messages, "pd-fields", model="tiny-k3", **fields)
    assert_same_output(got, want)
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert report is not None and not report["failed"] and report["values_stored"] == {"states": 1}, report
    needed = (got["usage"]["prompt_tokens"] - 1) // PAGE_SIZE
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == needed * PAGE_SIZE


def test_a_prefill_worker_of_another_model_is_refused_naming_both_layouts(hybrid_pd, capsys):
    """The checkpoint layout is part of what prefill and decode workers must share."""
    from kvtier.cli import main

    code = main(["serve", "tiny", "--tokenizer", str(TOKENIZER_DIR), "--role", "prefill",
                 "--decode-workers", hybrid_pd["decode"].url, "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "has layouts {'blocks'" in err and "'states': {" in err and "'row_bytes'" in err, err
