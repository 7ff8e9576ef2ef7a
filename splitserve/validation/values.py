"""Readers of one JSON value of a request: the optional typed value (one reader for every field),
a number in a range, a list of token ids, and how an error names a value's type."""

from __future__ import annotations

import math
from typing import Any, Optional

from splitserve.engine.io import InvalidRequest

_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def opt(obj: dict, key: str, prefix: str, kind: type, minimum=None, maximum=None) -> Any:
    """``obj[key]`` checked as ``kind`` (int, float: any finite number, returned as a float; bool;
    str) and within ``minimum``/``maximum``, or None when absent or null. A bool is no number."""
    v = obj.get(key)
    if v is None:
        return None
    name = prefix + key
    accepted = (int, float) if kind is float else kind
    if (isinstance(v, bool) and kind is not bool) or not isinstance(v, accepted):
        raise InvalidRequest(f"{name} must be {_KIND_NAMES[kind]}, not {type_name(v)}", name)
    if kind is float and not math.isfinite(v):
        raise InvalidRequest(f"{name} must be a finite number", name)
    if minimum is not None and v < minimum:
        raise InvalidRequest(f"{name} must be at least {minimum}, got {v}", name)
    if maximum is not None and v > maximum:
        raise InvalidRequest(f"{name} must be at most {maximum}, got {v}", name)
    return float(v) if kind is float else v


def opt_range(obj: dict, key: str, prefix: str, low: float, high: float, open_below: bool = False) -> Optional[float]:
    """A number in [low, high] (``(low, high]`` with ``open_below``), or None when absent."""
    v = opt(obj, key, prefix, float)
    if v is not None and not ((low < v if open_below else low <= v) and v <= high):
        bounds = f"({low:g}, {high:g}]" if open_below else f"[{low:g}, {high:g}]"
        raise InvalidRequest(f"{prefix}{key} must be in {bounds}, got {v:g}", prefix + key)
    return v


def token_ids(v: Any, name: str, vocab_size: Optional[int], allow_empty: bool = False,
              max_count: Optional[int] = None) -> Optional[list[int]]:
    """A list of token ids, each in ``[0, vocab_size)``; None stays None."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise InvalidRequest(f"{name} must be a list of token ids, not {type_name(v)}", name)
    if not v and not allow_empty:
        raise InvalidRequest(f"{name} is empty", name)
    if max_count is not None and len(v) > max_count:
        raise InvalidRequest(f"{name} takes at most {max_count} token ids, got {len(v)}", name)
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequest(f"{name}[{i}] must be an integer token id, not {type_name(t)}", name)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f" in [0, {vocab_size})" if vocab_size is not None else " >= 0"
            raise InvalidRequest(f"{name}[{i}] = {t} is not a token id{bound}", name)
    return list(v)
