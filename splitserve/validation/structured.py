"""Structured output: the grammar an answer must follow (``response_format``, SGLang's ``regex``
or ``json_schema``, or a forced tool call), the chat's tools, and the field a refusal names."""

from __future__ import annotations

from typing import Any, Optional

from splitserve.engine.grammar import parse_response_format, parse_tools, sglang_spec
from splitserve.engine.io import InvalidRequest


def structured(body: dict, fields: dict, endpoint: str) -> tuple[Any, Any]:
    """The grammar the answer must follow and the chat's tools; None for either when absent."""
    grammar_spec = parse_response_format(body.get("response_format")) if endpoint != "generate" else \
        sglang_spec(fields)
    tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")) \
        if endpoint == "chat" else None
    if tools is not None and tools.grammar is not None:
        if grammar_spec is not None:
            raise InvalidRequest("a forced tool call (tool_choice required or a function) and response_format "
                                 "cannot be given together", "tool_choice")
        grammar_spec = tools.grammar
    return grammar_spec, tools


def grammar_param(spec, endpoint: str, grammars, tokenizer, vocab_size: Optional[int]) -> Optional[str]:
    """The field a refusal of ``spec`` names, when ``grammars`` is to compile it (with a
    tokenizer: its view of the tokenizer is built here, once per worker, in this thread)."""
    if spec is None or grammars is None or tokenizer is None:
        return None
    grammars.prepare(tokenizer, vocab_size or len(tokenizer))
    if spec.kind == "lark":
        return "tool_choice"
    return "response_format" if endpoint != "generate" else f"sampling_params.{spec.kind}"
