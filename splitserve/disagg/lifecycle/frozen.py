"""A room's fields as a hashable value, its times relative to a moment (``RoomTable.canonical``,
with which the interleaving explorer merges equal states: nothing in a table depends on the
clock's origin)."""

from __future__ import annotations

from dataclasses import fields


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(value))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


_TIMES = frozenset({"born", "entered", "deadline"})


def frozen_fields(obj, now: float) -> tuple:
    """The fields of a room as a hashable tuple, its times relative to ``now``."""
    return tuple(
        (f.name, _freeze(value) if f.name not in _TIMES or value is None else value - now)
        for f in fields(obj) for value in (getattr(obj, f.name),)
    )
