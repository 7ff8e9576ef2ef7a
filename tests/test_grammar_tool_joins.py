"""Regexes joined across tools are counted on the tool-call schema as the grammar engine sees it:
a ``$ref`` in one tool's parameters resolves against the combined schema of a forced call, so it
can reach every other tool's parameters, and the join it makes is bounded like any other (a 400
before anything compiles). Tools whose patterns sit on different values are accepted."""

from __future__ import annotations

import pytest

from splitserve.engine.grammar import MAX_INTERSECTED_PATTERNS, parse_tools
from splitserve.errors import InvalidRequest

N = 22  # joined, these compile for seconds to minutes


def pattern(i: int) -> str:
    return f"^.*a.{{{i}}}$"


def tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def cross_ref_tools(n: int) -> list:
    """Tool 0 joins, by ``$ref``s into the combined schema, the one pattern of each of tools 1..n."""
    join = {"type": "string", "allOf": [{"$ref": f"#/anyOf/{j}/properties/arguments"} for j in range(1, n + 1)]}
    return [tool("t0", join)] + [tool(f"t{j}", {"type": "string", "pattern": pattern(j)}) for j in range(1, n + 1)]


@pytest.mark.parametrize("parallel", [False, True])
def test_a_join_across_tools_is_refused(parallel):
    with pytest.raises(InvalidRequest) as err:
        parse_tools(cross_ref_tools(N), "required", parallel)
    assert "regexes" in str(err.value) and err.value.param == "tools"


def test_a_named_tool_grammar_holds_that_tool_alone():
    """Its ``$ref``s cannot reach the other tools' patterns: they are not in its grammar."""
    spec = parse_tools(cross_ref_tools(N), {"type": "function", "function": {"name": "t0"}}, False).grammar
    assert "pattern" not in spec.schema


def test_tools_with_many_patterns_on_different_values_are_accepted():
    tools = [tool(f"t{j}", {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern(j)}}})
             for j in range(4 * MAX_INTERSECTED_PATTERNS)]
    assert parse_tools(tools, "required", True).grammar is not None


def test_auto_compiles_nothing_so_nothing_joins():
    assert parse_tools(cross_ref_tools(N), "auto", True).grammar is None
