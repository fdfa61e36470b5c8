"""Every public option is checked at construction: type (bools are not ints, strings are not
sizes, ints are not paths or salts) and range (sizes that give zero slots are errors), with a
message naming the option, the value and what was expected."""

import math

import numpy as np
import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.cache.disk_tier import DiskTier
from kvtier.cache.host_tier import HostTier
from kvtier.cache.config import PoolConfig
from kvtier.cli import main
from kvtier.serve.config import EngineConfig

BLOCK = 15360  # tiny preset, fp32, page_size 16

SIZE_BAD = [True, False, "1G", "1024", 1.5, 1024.0, None, -1]
COUNT_BAD = [True, "8", 8.0, 0, -3, None]
BOOL_BAD = ["no", "false", 0, 1, None, "True"]

ENGINE_PROBES = (
    [("page_size", v) for v in (True, "16", 16.0, 0, -16, 12, None)]
    + [(n, v) for n in ("num_device_pages", "max_num_batched_tokens", "max_num_seqs") for v in COUNT_BAD]
    + [("enable_prefix_caching", v) for v in BOOL_BAD]
    + [(n, v) for n in ("host_cache_bytes", "disk_cache_bytes") for v in SIZE_BAD]
    + [("disk_cache_dir", v) for v in (123, b"/tmp/x", "", True, 1.5)]
    + [("cache_policy", v) for v in ("LRU", "fifo", 1, None, True)]
    + [("write_policy", v) for v in ("write_through", "", 0, None)]
    + [("salt", v) for v in (123, "tenant", None, True, ["a"])]
    + [("seed", v) for v in (True, -1, "0", 1.5, 2**63, None)]
)


def _message_names(err: Exception, name: str, value) -> None:
    msg = str(err)
    assert name in msg, msg
    assert repr(value) in msg or (value == "" and "''" in msg), msg


@pytest.mark.parametrize(("name", "value"), ENGINE_PROBES)
def test_engine_config_rejects(name, value):
    with pytest.raises(ValueError) as e:
        EngineConfig.of(**{name: value})  # flat, as LLM(**engine_args) passes them
    _message_names(e.value, name, value)


def test_engine_config_embeds_the_pool_config():
    pool = PoolConfig(page_size=32, host_cache_bytes=1 << 20, write_policy="write-back", salt=b"t")
    assert EngineConfig(pool=pool, max_num_seqs=4) == EngineConfig.of(
        page_size=32, host_cache_bytes=1 << 20, write_policy="write-back", salt=b"t", max_num_seqs=4)
    with pytest.raises(ValueError, match="pool must be a PoolConfig"):
        EngineConfig(pool={"page_size": 32})
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['cache_write_policy'\]"):
        EngineConfig.of(cache_write_policy="write-back")


POOL_PROBES = (
    [(n, v) for n, v in ENGINE_PROBES if n in ("page_size", "num_device_pages", "host_cache_bytes",
                                               "disk_cache_bytes", "disk_cache_dir", "cache_policy")]
    + [("write_policy", v) for v in ("write_through", None, 1)]
    + [("enable_prefix_caching", v) for v in ("no", 1)]
    + [("salt", v) for v in ("tenant", 5, None)]
    + [("copy_threads", v) for v in (True, 0, "2", 2.0)]
)


@pytest.mark.parametrize(("name", "value"), POOL_PROBES)
def test_pool_config_rejects(name, value):
    with pytest.raises(ValueError) as e:
        PoolConfig(**{name: value})
    _message_names(e.value, name, value)


def test_disk_dir_needs_a_budget_and_paths_are_not_created_from_ints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="disk_cache_bytes > 0"):
        PoolConfig(disk_cache_dir=str(tmp_path / "d"))
    with pytest.raises(ValueError, match="disk_cache_dir"):
        PoolConfig(disk_cache_dir=123, disk_cache_bytes=1 << 20, host_cache_bytes=1 << 20)
    assert not (tmp_path / "123").exists()
    assert PoolConfig(disk_cache_dir=tmp_path, disk_cache_bytes=1 << 20).disk_cache_dir == tmp_path  # a Path is fine


SAMPLING_PROBES = (
    [("max_tokens", v) for v in (True, 0, "4", 1.5, None)]
    + [("temperature", v) for v in ("1", True, math.nan, math.inf, -1.0, None)]
    + [("top_p", v) for v in (0, 1.5, "0.9", True, math.nan, None)]
    + [("seed", v) for v in (True, -1, "1", 2**63, 1.0)]
    + [(n, v) for n in ("ignore_eos", "logprobs", "prompt_logprobs", "parallel_tool_calls") for v in ("no", 1, None)]
)


@pytest.mark.parametrize(("name", "value"), SAMPLING_PROBES)
def test_sampling_params_rejects(name, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    _message_names(e.value, name, value)


LLM_PROBES = [("model", 123), ("model", None), ("dtype", "fp32"), ("dtype", 1), ("device", 5),
              ("device", "gpu0"), ("seed", True), ("seed", "0"), ("seed", -1), ("tokenizer", 5),
              ("salt", 123), ("salt", "tenant"), ("host_cache_bytes", "1G"), ("disk_cache_dir", 123),
              ("enable_prefix_caching", "no"), ("max_num_seqs", True)]


@pytest.mark.parametrize(("name", "value"), LLM_PROBES)
def test_llm_rejects(name, value):
    args = {"model": "tiny", name: value}
    with pytest.raises(ValueError) as e:
        LLM(**args)
    _message_names(e.value, name, value)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", page_size=16, num_device_pages=32)


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("host_cache_bytes", 10, "holds no block"),
    ("host_cache_bytes", BLOCK - 1, "holds no block"),
    ("host_cache_bytes", HostTier.row_bytes(BLOCK) - 1, "holds no block"),
    ("disk_cache_bytes", DiskTier.file_bytes(BLOCK) - 1, "holds no block"),
    ("disk_cache_bytes", 100, "holds no block"),
])
def test_sizes_that_give_zero_slots_are_errors(tmp_path, name, value, expected):
    args = dict(page_size=16, num_device_pages=8, host_cache_bytes=4 * BLOCK, disk_cache_dir=str(tmp_path),
                disk_cache_bytes=1 << 20)
    if name == "host_cache_bytes":
        del args["disk_cache_dir"], args["disk_cache_bytes"]
    args[name] = value
    with pytest.raises(ValueError, match=f"{name}={value} {expected}"):
        LLM("tiny", **args)


def test_one_slot_is_enough(tmp_path):
    llm = LLM("tiny", page_size=16, num_device_pages=8, host_cache_bytes=HostTier.row_bytes(BLOCK),
              disk_cache_dir=str(tmp_path),
              disk_cache_bytes=DiskTier.file_bytes(BLOCK))
    assert llm.engine.pool.tiers.host.num_slots == 1 and llm.engine.pool.stats().disk_capacity_blocks == 1


@pytest.mark.parametrize("bad", [[1, True, 3], [1, np.True_, 3], np.array([True, False]), [1, 2.0], [1, "2"],
                                 torch.tensor([True, True]), [1, None]])
def test_bools_and_other_non_ints_are_not_token_ids(llm, bad):
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]"):
        llm.generate(prompt_token_ids=[bad], sampling_params=SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(("prompts", "params", "match"), [
    ("abc", None, "prompt_token_ids"),
    (5, None, "prompt_token_ids"),
    ([[1, 2]], 5, "sampling_params"),
    ([[1, 2]], "greedy", "sampling_params"),
    ([[1, 2]], [object()], "sampling_params"),
])
def test_generate_rejects_wrong_containers(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt_token_ids=prompts, sampling_params=params)


@pytest.mark.parametrize("policy", ["lru", "tool-aware"])
@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(token_ids="abc"), "token_ids"),
    (dict(token_ids=[1, True]), "token_ids[1]"),
    (dict(token_ids=[1, 2.5]), "token_ids[1]"),
    (dict(token_ids=None), "token_ids"),
    (dict(token_ids=np.zeros((2, 2), dtype=np.int64)), "token_ids"),
    (dict(expected_wait_s="1"), "expected_wait_s"),
    (dict(expected_wait_s=True), "expected_wait_s"),
    (dict(expected_wait_s=math.nan), "expected_wait_s"),
    (dict(expected_wait_s=math.inf), "expected_wait_s"),
    (dict(expected_wait_s=-1.0), "expected_wait_s"),
    (dict(session_id=["unhashable"]), "session_id"),
])
def test_tool_wait_is_checked_under_every_policy(policy, kwargs, name):
    llm = LLM("tiny", page_size=16, num_device_pages=8, cache_policy=policy)
    args = dict(session_id="s", token_ids=list(range(40)), expected_wait_s=1.0) | kwargs
    with pytest.raises(ValueError) as e:
        llm.engine.pool.tool_wait(**args)
    assert name in str(e.value)
    llm.engine.pool.tool_wait("s", np.arange(40, dtype=np.uint32), 0.0)  # good arguments still work


@pytest.mark.parametrize(("argv", "name"), [
    (["--page-size", "12"], "page_size"),
    (["--page-size", "0"], "page_size"),
    (["--num-device-pages", "0"], "num_device_pages"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--max-num-batched-tokens", "-5"], "max_num_batched_tokens"),
    (["--host-cache-bytes", "-1"], "host_cache_bytes"),
    (["--host-cache-bytes", "10"], "host_cache_bytes"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "-1"], "temperature"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--seed", "-1"], "seed"),
])
def test_cli_generate_reports_bad_values(capsys, argv, name):
    rc = main(["generate", "--num-prompts", "1", "--prompt-len", "8", "--shared-prefix-len", "0",
               "--max-tokens", "1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "error" in err and name in err


@pytest.mark.parametrize("argv", [["--page-size", "x"], ["--host-cache-bytes", "1G"], ["--temperature", "hot"],
                                  ["--seed", "1.5"]])
def test_cli_rejects_wrong_types_with_the_option_name(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["generate", *argv])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("name", ["ignore_eos", "prompt_logprobs", "parallel_tool_calls"])
def test_flag_messages_say_only_what_the_flag_is(name):
    # the note on top-N alternatives belongs to logprobs alone
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: "x"})
    _message_names(e.value, name, "x")
    assert "top-N" not in str(e.value) and "True or False" in str(e.value), str(e.value)


def test_a_kv_cache_too_large_to_allocate_names_num_device_pages():
    # 2**40 pages of the tiny model are petabytes: the allocator's RuntimeError named no option
    with pytest.raises(ValueError, match=r"num_device_pages=1099511627776 .*bytes"):
        LLM("tiny", page_size=16, num_device_pages=2**40)


@pytest.mark.parametrize("value, expected", [
    ("{", "must be a JSON object, got '{'"),
    ("[1]", "must be a JSON object, got list"),
    ('{"no_such": 1}', "unknown field(s) ['no_such']"),
    ('{"mask_deadline_s": -1}', "mask_deadline_s must be a number > 0, got -1"),
])
def test_cli_serve_reports_bad_grammar_limits(capsys, value, expected):
    # checked before any model or server is built
    assert main(["serve", "tiny", "--grammar-limits", value]) == 2
    err = capsys.readouterr().err
    assert "--grammar-limits" in err and expected in err, err


def test_grammar_limits_flag_parses_to_grammar_limits():
    from kvtier.cli.serve import parse_grammar_limits
    from kvtier.toolcall import GrammarLimits

    assert parse_grammar_limits(None) is None
    limits = parse_grammar_limits('{"max_grammar_size": 100000, "mask_deadline_s": 1}')
    assert isinstance(limits, GrammarLimits) and limits.max_grammar_size == 100000 and limits.mask_deadline_s == 1
