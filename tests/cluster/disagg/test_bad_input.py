"""Bad input at start-up and per request: clear errors naming the argument, nothing dropped."""

import httpx
import pytest

from kvtier.cli import main
from tests.cluster.disagg.helpers import free_dead_url


def test_unknown_role_is_a_startup_error(capsys):
    with pytest.raises(SystemExit) as e:  # refused by the parser, which lists the choices
        main(["serve", "tiny", "--role", "router"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --role: invalid choice: 'router' (choose from 'prefill', 'decode', 'both')" in err
    from kvtier.cluster.disagg import check_role

    with pytest.raises(ValueError, match=r"--role must be one of \['prefill', 'decode', 'both'\], got 'router'"):
        check_role("router")  # the library's own check, for callers that build no parser


def test_prefill_worker_without_a_reachable_decode_worker_does_not_start(capsys):
    dead = free_dead_url()
    assert main(["serve", "tiny", "--role", "prefill", "--decode-workers", dead]) == 2
    err = capsys.readouterr().err
    assert "no decode worker reachable among --decode-workers" in err and dead in err
    assert main(["serve", "tiny", "--role", "prefill"]) == 2
    assert "--role prefill needs --decode-workers" in capsys.readouterr().err


def test_decode_workers_only_with_role_prefill(capsys):
    assert main(["serve", "tiny", "--role", "decode", "--decode-workers", "http://127.0.0.1:1"]) == 2
    assert "--decode-workers is for --role prefill" in capsys.readouterr().err


def test_prefill_worker_with_a_non_decode_worker_does_not_start(pd, capsys):
    assert main(["serve", "tiny", "--role", "prefill", "--decode-workers", pd["prefill"].url]) == 2
    assert "role 'prefill', expected decode or both" in capsys.readouterr().err


def test_router_checks_roles_and_flags(pd, capsys):
    assert main(["router", "--prefill-workers", pd["decode"].url, "--decode-workers", pd["prefill"].url,
                 "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"--prefill-workers {pd['decode'].url}: role 'decode', expected prefill" in err
    assert f"--decode-workers {pd['prefill'].url}: role 'prefill', expected decode or both" in err
    assert main(["router", "--prefill-workers", pd["prefill"].url, "--port", "0"]) == 2
    assert "give either --workers" in capsys.readouterr().err


def test_prefill_worker_refuses_turns_it_cannot_decode(pd):
    r = httpx.post(f"{pd['prefill'].url}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "role"
    assert "--role prefill" in r.json()["error"]["message"]


@pytest.mark.parametrize("target", ["", "http://127.0.0.1:9"])
def test_prefill_refuses_a_decode_url_it_was_not_given(pd, target):
    r = httpx.post(f"{pd['prefill'].url}/v1/kv/prefill/chat/completions", timeout=30,
                   headers={"x-kvtier-decode-url": target},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-kvtier-decode-url"


@pytest.mark.parametrize("body", [{}, {"block_hashes": "00"}, {"block_hashes": ["xyz"]}, [1]])
def test_held_query_names_block_hashes(pd, body):
    r = httpx.post(f"{pd['decode'].url}/v1/kv/held", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "block_hashes"


def test_corrupt_values_are_counted_never_registered(pd):
    decode = pd["decode"]
    info = httpx.get(f"{decode.url}/v1/kv/info", timeout=10).json()
    size = 64 + info["layouts"]["blocks"]["payload_bytes"]
    r = httpx.post(f"{decode.url}/v1/kv/blocks", content=bytes(2 * size + 10), timeout=30)
    assert r.status_code == 200
    assert r.json() == {"stored": 0, "duplicate": 0, "refused": 0, "corrupt": 2, "truncated": 1}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_roles_need_prefix_caching(role, capsys):
    assert main(["serve", "tiny", "--role", role, "--no-prefix-caching"]) == 2
    assert f"--role {role} needs prefix caching" in capsys.readouterr().err
