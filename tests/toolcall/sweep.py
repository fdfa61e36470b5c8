"""The tool-call validity sweep: constrained turns of the tiny random model for real requests
(K2-Vendor-Verifier) and for tools built from every valid schema of Moonshot's validator set,
each call's arguments checked with ``jsonschema``.

Run the whole sweep and print its numbers:
    PYTHONPATH=python python tests/toolcall/sweep.py [--model tiny|tiny-k3] [--seeds 0 1] [--temperatures 0 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
K2VV_DIR = SHARED / "toolcalls" / "K2-Vendor-Verifier"
WALLE_DIR = SHARED / "toolcalls" / "walle" / "testdata" / "validator_cases"
TOKENIZER_DIR = SHARED / "kimi_tokenizer"
SLACK_TOKENS = 24  # tokens the model chooses freely beyond the shortest complete turn
ASK = [{"role": "user", "content": "Call the tool with suitable arguments."}]


@dataclass
class Case:
    """One constrained request: conversation, tools, and the schema per tool name for checking."""

    name: str
    messages: list[dict]
    tools: list[dict]

    @property
    def schemas(self) -> dict[str, dict]:
        return {
            t["function"]["name"]: t["function"].get("parameters", {})
            for t in self.tools
        }


def k2vv_cases() -> list[Case]:
    """Every request of K2-Vendor-Verifier's samples.jsonl and medium.jsonl (``_input`` turns
    become system turns, as the upstream eval script does)."""
    cases = []
    for fname in ("samples.jsonl", "medium.jsonl"):
        for i, line in enumerate((K2VV_DIR / fname).read_text().splitlines()):
            r = json.loads(line)
            msgs = [
                dict(m, role="system") if m["role"] == "_input" else m
                for m in r["messages"]
            ]
            cases.append(Case(f"{fname}:{i}", msgs, r["tools"]))
    return cases


def as_parameters(schema: dict) -> dict:
    """A walle case as tool parameters: object schemas as they are; others wrapped as the
    required property ``value`` (their ``$defs`` moved to the wrapper's root, ``$id`` dropped)."""
    if schema.get("type") in ("object", ["object"]):
        return schema
    inner = {k: v for k, v in schema.items() if k not in ("$defs", "$id")}
    wrapped = {"type": "object", "properties": {"value": inner}, "required": ["value"]}
    if "$defs" in schema:
        wrapped["$defs"] = schema["$defs"]
    return wrapped


def walle_cases() -> list[Case]:
    """One single-tool request per valid schema of the validator set (213)."""
    cases = []
    for path in sorted(WALLE_DIR.glob("*/valid.jsonl")):
        for i, line in enumerate(path.read_text().splitlines()):
            params = as_parameters(json.loads(line))
            tool = {
                "type": "function",
                "function": {"name": "tool", "parameters": params},
            }
            cases.append(Case(f"{path.parent.name}:{i}", ASK, [tool]))
    return cases


def check_arguments(arguments: str, schema: dict) -> str | None:
    """None when ``arguments`` (JSON text) validates against ``schema``, else the reason.
    ``$id`` is dropped: jsonschema would resolve ``$ref`` against it as a base URI."""
    import jsonschema

    schema = {k: v for k, v in schema.items() if k != "$id"}
    try:
        jsonschema.Draft202012Validator(schema).validate(json.loads(arguments))
    except (jsonschema.ValidationError, ValueError) as e:
        return str(e).splitlines()[0]
    return None


@dataclass
class Tally:
    requests: int = 0
    complete: int = 0  # at least one call and no problem
    calls: int = 0
    valid_calls: int = 0
    failures: list = field(default_factory=list)
    outcomes: collections.Counter = field(default_factory=collections.Counter)

    def line(self) -> str:
        pct = 100.0 * self.valid_calls / self.calls if self.calls else 0.0
        return (
            f"{self.requests} requests, {self.complete} complete, {self.calls} calls, {self.valid_calls} valid "
            f"({pct:.1f}%), outcomes {dict(self.outcomes)}"
        )


def shortest_turns(llm, cases: list[Case]) -> list[int | None]:
    """Tokens of the shortest complete turn each case's grammar allows (None: no grammar)."""
    from kvtier import SamplingParams
    from kvtier.toolcall import JsonNesting, closing_tokens

    llm.engine.attach_tokenizer(llm.tokenizer)
    out = []
    for c in cases:
        params = SamplingParams(tools=c.tools, tool_choice="required")
        try:
            con = llm.engine.grammar.constraint(params)
            con.prime(generation_tail(llm.tokenizer))
        except ValueError:
            out.append(None)
            continue
        path = closing_tokens(con.matcher, con.table, JsonNesting())
        out.append(len(path) if path else None)
    return out


def generation_tail(tokenizer) -> list[int]:
    """The prompt tokens a K3 turn grammar is primed with (the generation prompt's think channel);
    [] for K2's template."""
    from kvtier.tokenize import ChatFormat

    if tokenizer.chat_format is not ChatFormat.K3_XTML:
        return []
    from kvtier.tokenize.xtml import encode_part, generation_prompt

    return encode_part(tokenizer, generation_prompt(True))[-3:]


def prompt_ids(tokenizer, case: Case) -> list[int]:
    """``case``'s prompt in the tokenizer's chat format (K3: thinking on, the tool-choice tail)."""
    from kvtier.tokenize import ChatFormat, render_chat

    if tokenizer.chat_format is not ChatFormat.K3_XTML:
        return tokenizer.encode(render_chat(case.messages, case.tools))
    from kvtier.tokenize.xtml import XtmlOptions, encode_xtml

    return encode_xtml(tokenizer, case.messages, case.tools, XtmlOptions(tool_choice="required"))


def rendered(tokenizer, cases: list[Case]) -> list[Case]:
    """The cases whose prompt the tokenizer's chat format renders (K3's renderer refuses tool
    parameters whose root is not an object schema: a 400 before any grammar)."""
    kept = []
    for c in cases:
        try:
            prompt_ids(tokenizer, c)
        except ValueError:
            continue
        kept.append(c)
    return kept


def run(
    llm, cases: list[Case], temperature: float, seed: int, slack: int = SLACK_TOKENS
) -> Tally:
    """Generate one required-tool turn per case (all in one batch, in the model's chat format) and
    check every call."""
    from kvtier import SamplingParams

    tally = Tally()
    shortest = shortest_turns(llm, cases)
    prompts, params = [], []
    for c, n in zip(cases, shortest):
        prompts.append(prompt_ids(llm.tokenizer, c))
        params.append(
            SamplingParams(
                max_tokens=(n or 1) + slack,
                temperature=temperature,
                seed=seed,
                tools=c.tools,
                tool_choice="required",
            )
        )
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for c, out in zip(cases, outs):
        tally.requests += 1
        if out.finish_reason == "error":
            tally.outcomes["error"] += 1
            tally.failures.append((c.name, out.error[:200]))
            continue
        complete = bool(out.tool_calls) and not out.tool_call_problems
        tally.complete += complete
        tally.outcomes["complete" if complete else "incomplete"] += 1
        if not complete:
            tally.failures.append((c.name, f"problems {out.tool_call_problems}"[:200]))
        for call in out.tool_calls:
            tally.calls += 1
            reason = check_arguments(call["arguments"], c.schemas[call["name"]])
            if reason is None:
                tally.valid_calls += 1
            else:
                tally.failures.append((c.name, f"invalid arguments: {reason}"[:200]))
    return tally


def main() -> None:
    from kvtier import LLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1],
        help="model weight and sampling seeds",
    )
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument(
        "--limit",
        type=int,
        default=None,
        help="first N cases of each set (default all)",
    )
    ap.add_argument("--model", choices=["tiny", "tiny-k3"], default="tiny",
                    help="tiny-k3: K3's tokenizer files and XTML turns (cases K3's renderer refuses are left out)")
    args = ap.parse_args()
    tokenizer_dir = TOKENIZER_DIR
    if args.model == "tiny-k3":
        import tempfile

        from kvtier.tokenize import ChatFormat, copy_tokenizer

        tokenizer_dir = copy_tokenizer(TOKENIZER_DIR, tempfile.mkdtemp(), chat_format=ChatFormat.K3_XTML)
    for seed in args.seeds:
        pages = 4096 if args.model == "tiny" else 8192
        llm = LLM(args.model, tokenizer=tokenizer_dir, seed=seed, num_device_pages=pages)
        for temperature in args.temperatures:
            for set_name, cases in (
                ("K2-Vendor-Verifier", k2vv_cases()),
                ("walle", walle_cases()),
            ):
                t0 = time.perf_counter()
                tally = run(llm, rendered(llm.tokenizer, cases[: args.limit]), temperature, seed)
                print(
                    f"seed {seed} temperature {temperature} {set_name}: {tally.line()} "
                    f"[{time.perf_counter() - t0:.0f} s]",
                    flush=True,
                )
                for name, why in tally.failures:
                    print(f"    {name}: {why}", flush=True)


if __name__ == "__main__":
    main()
