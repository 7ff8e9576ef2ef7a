"""Regexes a schema intersects on one value are counted at the edge, whichever form joins them:
``allOf``, a ``$ref`` beside a ``pattern`` (a chain of them through ``$defs``), and an ``anyOf``
beside a ``pattern`` (nested); more than the bound is a 400 naming it before anything compiles.
A schema whose many patterns sit on different values (an object's fields, optional fields as
``anyOf`` with ``null``, ``$ref`` beside a description only) is accepted."""

from __future__ import annotations

import pytest

from splitserve.engine.grammar import MAX_INTERSECTED_PATTERNS, schema_spec
from splitserve.errors import InvalidRequest

N = 22  # joined, these compile for minutes (18 took 0.27 s of CPU, each 2 more about x6)


def pattern(i: int) -> str:
    return f"^.*a.{{{i}}}$"


def all_of(n: int) -> dict:
    return {"type": "string", "allOf": [{"pattern": pattern(i)} for i in range(n)]}


def ref_chain(n: int) -> dict:
    """Each definition a ``$ref`` to the previous one beside a pattern of its own."""
    defs = {"p0": {"type": "string", "pattern": pattern(0)}}
    for i in range(1, n):
        defs[f"p{i}"] = {"$ref": f"#/$defs/p{i - 1}", "pattern": pattern(i)}
    return {"$defs": defs, "$ref": f"#/$defs/p{n - 1}"}


def nested_any_of(n: int) -> dict:
    """A pattern beside an ``anyOf`` whose one choice is a pattern beside an ``anyOf``, and so on."""
    schema = {"type": "string", "pattern": pattern(n - 1)}
    for i in range(n - 2, -1, -1):
        schema = {"type": "string", "pattern": pattern(i), "anyOf": [schema]}
    return schema


def ref_beside_pattern(n: int) -> dict:
    """A ``$ref`` beside a pattern, its target the other patterns joined by ``allOf`` (in a property)."""
    return {"$defs": {"t": all_of(n - 1)}, "type": "object",
            "properties": {"x": {"$ref": "#/$defs/t", "pattern": pattern(n)}}}


FORMS = {"allOf": all_of, "$ref chain": ref_chain, "nested anyOf": nested_any_of, "$ref beside": ref_beside_pattern}


@pytest.mark.parametrize("form", FORMS)
def test_every_form_that_intersects_patterns_is_counted(form):
    """Past the bound, each form is a 400 naming the bound; at the bound, each passes. Nested
    ``anyOf`` goes to 16 patterns, the most the depth cap lets in (two levels each)."""
    make, n = FORMS[form], 16 if form == "nested anyOf" else N
    with pytest.raises(InvalidRequest, match=f"joins {n} regexes .* at most {MAX_INTERSECTED_PATTERNS}") as e:
        schema_spec(make(n), "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema"
    schema_spec(make(MAX_INTERSECTED_PATTERNS), "s")
    with pytest.raises(InvalidRequest, match="regexes"):
        schema_spec(make(MAX_INTERSECTED_PATTERNS + 1), "s")


def test_patterns_on_different_values_are_not_joined():
    """Many patterns on different fields, optional fields (``anyOf`` with ``null`` beside only a
    title and a default), a ``$ref`` beside only a description, an ``anyOf`` of patterns with no
    constraint beside it, and a small ``allOf`` of its own inside: all accepted."""
    fields = {f"f{i}": {"type": "string", "pattern": pattern(i)} for i in range(N)}
    optional = {f"o{i}": {"anyOf": [{"type": "string", "pattern": pattern(i)}, {"type": "null"}],
                          "default": None, "title": f"O{i}"} for i in range(N)}
    defs = {f"D{i}": {"type": "string", "pattern": pattern(i)} for i in range(N)}
    refs = {f"r{i}": {"$ref": f"#/$defs/D{i}", "description": "a field"} for i in range(N)}
    spec = schema_spec({"type": "object", "$defs": defs, "properties": {
        **fields, **optional, **refs, "choice": {"anyOf": [{"pattern": pattern(i)} for i in range(N)]},
        "joined": all_of(MAX_INTERSECTED_PATTERNS)}}, "s")
    assert spec.kind == "json_schema" and f'"r{N - 1}"' in spec.schema  # accepted whole
