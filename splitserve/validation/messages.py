"""A chat request's ``messages``: each checked and normalised for the chat template (roles,
text content, an assistant's ``tool_calls`` with their arguments parsed, a tool's call id)."""

from __future__ import annotations

import json
from typing import Any

from splitserve.engine.grammar import MAX_TOOLS
from splitserve.engine.io import InvalidRequest
from splitserve.validation.values import type_name
from splitserve.validation_fields import ABSENT

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def check_messages(v: Any) -> tuple[dict, ...]:
    """The messages, each a dict the chat template takes (roles normalised, content as text)."""
    if v is ABSENT or v is None:
        raise InvalidRequest("messages is required", "messages")
    if not isinstance(v, list):
        raise InvalidRequest(f"messages must be a list, not {type_name(v)}", "messages")
    if not v:
        raise InvalidRequest("messages is empty", "messages")
    out = []
    for i, m in enumerate(v):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{name} must be an object, not {type_name(m)}", name)
        role = m.get("role")
        allowed = ("role", "content", "name") + {"assistant": ("tool_calls", "refusal"),
                                                 "tool": ("tool_call_id",)}.get(role, ())
        for key in m:
            if key not in allowed:
                raise InvalidRequest(f"`{name}.{key}` is not supported by this server", f"{name}.{key}")
        if role not in CHAT_ROLES:
            if isinstance(role, str) and role == "function":
                raise InvalidRequest(f"{name}.role `function` is not supported (use tools and the tool role)",
                                     f"{name}.role")
            raise InvalidRequest(f"{name}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}",
                                 f"{name}.role")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise InvalidRequest(f"{name}.name must be a string", f"{name}.name")
        msg = {"role": CHAT_ROLES[role]}
        calls = m.get("tool_calls")
        if role == "assistant" and calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"{name}.tool_calls")
            msg["content"] = _content(m["content"], f"{name}.content") if m.get("content") is not None else ""
        else:
            msg["content"] = _content(m.get("content"), f"{name}.content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not 0 < len(m["tool_call_id"]) <= 256:
                raise InvalidRequest(f"{name}.tool_call_id must be a string of 1 to 256 characters",
                                     f"{name}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None and role == "tool":
            msg["name"] = m["name"]
        out.append(msg)
    return tuple(out)


def _tool_calls(v: Any, name: str) -> list[dict]:
    """An assistant message's ``tool_calls``, for the chat template: ``arguments`` (a JSON string
    in OpenAI's API) parsed into an object, as templates write it with ``tojson`` (vLLM does so too)."""
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise InvalidRequest(f"{name} must be an array of at most {MAX_TOOLS} calls", name)
    out = []
    for j, call in enumerate(v):
        p = f"{name}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str) \
                or set(call) - {"id", "type", "function"} or set(fn) - {"name", "arguments"}:
            raise InvalidRequest(f"{p} must be {{\"id\", \"type\": \"function\", \"function\": "
                                 "{\"name\", \"arguments\": a JSON string}}", p)
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise InvalidRequest(f"{p}.id must be a string", f"{p}.id")
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError:
            raise InvalidRequest(f"{p}.function.arguments is not JSON", f"{p}.function.arguments") from None
        out.append({"id": call.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _content(v: Any, name: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type_name(part)
                raise InvalidRequest(f"{name}[{j}]: only text parts are supported, got {json.dumps(kind)}", name)
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(f"{name} must be a string or a list of text parts, not {type_name(v)}", name)

