"""The static bound on ``pattern`` keywords: each pattern's size with counted repetitions unrolled,
and the refusal (before any compile) of a pattern over ``GrammarLimits.max_pattern_size``,
naming the keyword's path wherever the pattern sits in the schema."""

import pytest

from kvtier.toolcall import GrammarLimitError, GrammarLimits, normalize_tools, pattern_size
from kvtier.toolcall.pattern_size import check_pattern_sizes
from tests.toolcall.pathological import PATHOLOGICAL, REFUSED

BASE = "tools[0].function.parameters"


@pytest.mark.parametrize("pattern, size", [
    ("", 0),
    ("^$", 0),
    ("abc", 3),
    ("a|bc", 3),                      # an alternation is the sum of its branches
    ("a{5}", 5),
    ("a{2,7}", 7),                    # the upper count
    ("a{,4}", 4),
    ("a{3,}", 3), ("a{0,}", 1),       # no upper count: the lower one, at least once
    ("a*b+c?", 3), ("a*?b+?c??", 3),  # lazy forms count the same
    ("a{2}{3}", 6),                   # stacked counts multiply
    ("(ab){3}", 6),
    ("(?:ab|c){4}", 12),
    ("(?P<n>ab){2}", 4), ("(?<n>ab){2}", 4), ("(?i:ab){2}", 4), ("(?i)ab", 2),
    ("((a{10}){10}){10}", 1000),      # nested counts multiply
    ("[a-z]{9}", 9), ("[]a]{2}", 2), ("[^]a]{2}", 2), ("[a-z&&[^aeiou]]{3}", 3),  # a class is one position
    (r"\d{4}-\d{2}", 7), (r"\p{L}{3}", 3), (r"\x{1F600}{2}", 2), (r"\({3}", 3),
    ("a{}", 3), ("a{,}", 4),          # not counts: literal braces
    ("^(a{1000}){1000}$", 1_000_000),
])
def test_size_unrolls_counted_repetitions(pattern, size):
    assert pattern_size(pattern) == size


def test_size_of_deep_nesting_does_not_recurse():
    assert pattern_size("(" * 50_000 + "a" + ")" * 50_000) == 1
    assert pattern_size("(a{2})" * 3 + "(" * 7) == 6  # unbalanced: still a finite count


def test_size_rejects_a_non_string():
    with pytest.raises(TypeError, match="pattern must be a str, got int"):
        pattern_size(5)


def _tools(parameters):
    return normalize_tools([{"type": "function", "function": {"name": "ok", "parameters": {}}},
                            {"type": "function", "function": {"name": "f", "parameters": parameters}}])


@pytest.mark.parametrize("name", sorted(n for n in REFUSED if REFUSED[n][1].endswith(".pattern")))
def test_a_pattern_over_the_limit_is_refused_naming_its_path(name):
    tool, where = REFUSED[name]
    specs = normalize_tools([{"type": "function", "function": {"name": "ok", "parameters": {}}}, tool])
    path = f"tools[1].function.parameters{where}"
    with pytest.raises(GrammarLimitError) as e:
        check_pattern_sizes(specs, GrammarLimits().max_pattern_size)
    assert e.value.path == path
    assert str(e.value).startswith(f"{path}: the tool grammar does not compile: the pattern has ")
    assert f"more than max_pattern_size={GrammarLimits().max_pattern_size:,}" in str(e.value)


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_the_pathological_set_under_the_limit_passes(name):
    check_pattern_sizes(normalize_tools([PATHOLOGICAL[name]]), GrammarLimits().max_pattern_size)


def test_the_limit_is_inclusive_and_configurable():
    specs = _tools({"type": "object", "properties": {"x": {"type": "string", "pattern": "^(ab){50}$"}}})
    check_pattern_sizes(specs, 100)
    with pytest.raises(GrammarLimitError, match=r"has 100 positions .* more than max_pattern_size=99 "):
        check_pattern_sizes(specs, 99)
    assert GrammarLimits.from_dict({"max_pattern_size": 99}).max_pattern_size == 99
    with pytest.raises(ValueError, match="max_pattern_size must be an int > 0, got 1.5"):
        GrammarLimits(max_pattern_size=1.5)


def test_values_that_are_not_schemas_are_not_checked():
    big = "a{100000}"
    specs = _tools({"type": "object", "properties": {
        "pattern": {"type": "string", "enum": [big]},                    # a property named "pattern"
        "y": {"type": "object", "properties": {}, "default": {"pattern": big}}}})
    check_pattern_sizes(specs, 10)


def test_the_first_offending_pattern_in_tool_order_is_named():
    small, big = {"type": "string", "pattern": "a{5}"}, {"type": "string", "pattern": "a{50}"}
    specs = normalize_tools([
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"s": small}}}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
            "a": {"type": "array", "items": big}}}}}])
    with pytest.raises(GrammarLimitError) as e:
        check_pattern_sizes(specs, 10)
    assert e.value.path == "tools[1].function.parameters.properties.a.items.pattern"
