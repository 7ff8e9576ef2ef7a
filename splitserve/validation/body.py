"""A request body as a whole: JSON, an object, text throughout, only the fields its place takes,
and the model it names."""

from __future__ import annotations

import json
from typing import Any, Optional

from splitserve.engine.io import InvalidRequest
from splitserve.outcomes import Reason
from splitserve.validation.values import opt, type_name
from splitserve.validation_fields import ABSENT, ANY_BOOL, NOOP


def parse_json_body(raw: bytes | str) -> dict:
    """Decode a request body into a JSON object, or raise InvalidRequest saying what is wrong."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"the request body is not valid UTF-8: {e}") from None
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")

    def _no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {type_name(body)}")
    return body


def check_text(body: Any) -> None:
    """Refuse a lone surrogate (``"\\ud800"``, legal JSON) anywhere in a parsed body, keys
    included: it is no character and cannot be encoded as UTF-8, so it would raise wherever the
    request is hashed (``cache_salt``), tokenized, logged or forwarded. One pass over the body,
    iterative (any depth); a pure-ASCII string is skipped in constant time."""
    todo: list[tuple[Any, str]] = [(body, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                raise InvalidRequest(f"{path or 'the request body'} holds a lone surrogate (\\ud800-\\udfff "
                                     "without its pair): not text", path or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not key.isascii() and not _encodable(key):
                    where = f"`{path}`" if path else "the request body"
                    raise InvalidRequest(f"a field name in {where} holds a lone surrogate: not text", path or None)
                todo.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, list):
            todo.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_fields(obj: dict, known: frozenset | set, prefix: str) -> None:
    """Each field of ``obj`` is in ``known``; a field not implemented holds its "not used" value."""
    for key, value in obj.items():
        name = prefix + str(key)
        if key not in known:
            raise InvalidRequest(f"unrecognized request field `{name}`", name)
        if key in NOOP and value is not None and not _is_noop(value, NOOP[key]):
            raise InvalidRequest(f"`{name}` is not supported by this server (got {json.dumps(value)})", name)


def _is_noop(value: Any, noop: Any) -> bool:
    if noop is ABSENT:
        return False
    if noop is ANY_BOOL:
        return isinstance(value, bool)
    if isinstance(noop, bool) or isinstance(value, bool):
        return type(value) is type(noop) and value == noop
    return value == noop


def check_model(body: dict, served_model_name: Optional[str]) -> Optional[str]:
    """The ``model`` the body names (None: none); another than the served one is a 404."""
    model = opt(body, "model", "", str)
    if model is not None and served_model_name is not None and model != served_model_name:
        raise InvalidRequest(f"The model `{model}` does not exist; this server serves `{served_model_name}`",
                             "model", reason=Reason.MODEL_NOT_FOUND)
    return model
