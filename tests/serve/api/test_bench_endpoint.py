"""``kvtier bench --endpoint`` against a running ``kvtier serve``: the built-in workload (token-id
prompts through /v1/completions) and text sessions (chat), with the bench's JSON."""

from __future__ import annotations

import json

from kvtier.cli import main
from tests.helpers.conversations import CONVERSATION, TOOLS
from tests.conftest import TOKENIZER_DIR


def _bench(tmp_path, server, *extra) -> dict:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--endpoint", server.url, "--model", "tiny", "--sessions", "3", "--concurrency", "2",
               "--max-turns", "2", "--ramp-s", "0", "--time-scale", "0.001", "--plot", str(tmp_path / "ttft.png"),
               "--json", str(out), *extra])
    assert rc == 0 and (tmp_path / "ttft.png").is_file()
    return json.loads(out.read_text())


def test_bench_endpoint_replays_the_builtin_workload(server, tmp_path):
    data = _bench(tmp_path, server, "--json-records")
    (run,) = data["configs"].values()
    assert {r["preemptions"] for r in run["records"]} == {None}  # per request too
    assert run["requests"] == data["provenance"]["workload"]["requests"] and run["errors"] == 0
    assert run["ttft_s"]["p50"] > 0 and run["output_tokens"] > 0
    assert data["provenance"]["endpoint"] == server.url
    assert run["preemptions"] is None and run["stores_refused"] is None  # the server's own: not seen over HTTP


def test_bench_endpoint_replays_conversations_through_chat(server, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION, "tools": TOOLS, "max_tokens": 6}, ensure_ascii=False) + "\n")
    data = _bench(tmp_path, server, "--conversations", str(path), "--tokenizer", str(TOKENIZER_DIR))
    (run,) = data["configs"].values()
    assert run["requests"] == data["provenance"]["workload"]["requests"] == 2 and run["errors"] == 0  # --max-turns 2
    assert run["hit_tokens"]["device"] > 0  # later turns of the session reuse the earlier turns' pages


def test_bench_endpoint_takes_an_openai_clients_base_url(server, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--endpoint", server.url + "/v1/", "--model", "tiny", "--sessions", "1", "--max-turns", "1",
                 "--ramp-s", "0", "--time-scale", "0.001", "--plot", "", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (run,) = data["configs"].values()
    assert run["requests"] == 1 and run["errors"] == 0 and data["provenance"]["endpoint"] == server.url


def test_bench_endpoint_names_a_model_the_server_lacks(server, tmp_path, capsys):
    assert main(["bench", "--endpoint", server.url, "--model", "gpt-9", "--plot", ""]) == 2
    assert "'gpt-9' is not served" in capsys.readouterr().err


def test_bench_endpoint_turns_that_stopped_on_a_tool_are_resumes_on_kvtier(tmp_path):
    """Built-in turns that stopped on ``tool_use`` declare their wait on /v1/completions, so the
    server counts the next turn of the session as a resume, and bench reports the server's count
    (a 1 us target: every resume misses it)."""
    from kvtier.bench.run import BenchOptions, prepare
    from tests.serve.api.conftest import start_server, stop_server

    s = start_server(tmp_path, "--num-device-pages", "1024", "--resume-ttft-s", "0.000001")
    try:
        data = _bench(tmp_path, s, "--max-turns", "4")
    finally:
        stop_server(s)
    (run,) = data["configs"].values()
    assert run["errors"] == 0
    workload = prepare(BenchOptions(sessions=3, concurrency=2, max_turns=4, time_scale=0.001, ramp_s=0.0))[2]
    expected = sum(1 for sess in workload.sessions for k in range(1, len(sess.turns))
                   if sess.turns[k - 1].stop == "tool_use")
    slo = data["provenance"]["resume_slo"]
    assert expected > 0 and slo["resumes"] == expected
    assert slo["target_s"] == 0.000001 and slo["missed"] == expected == sum(slo["misses"].values())
