"""The chat template: whether it renders tools, the text it makes of messages, and the prompt's
token ids."""

from __future__ import annotations

from typing import Mapping, Optional

from splitserve.engine.io import InvalidRequest


def template_tools(tools) -> dict:
    """The chat template's ``tools`` argument (none for ``tool_choice`` none: vLLM's
    ``--exclude-tools-when-tool-choice-none``, here always; OpenAI's model then calls no tool)."""
    return {"tools": [dict(t) for t in tools.tools]} if tools is not None and tools.parses else {}


_PROBE_TOOL = {"type": "function", "function": {"name": "splitserve_probe_function", "parameters": {}}}


def renders_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template writes the tools it is given into the prompt: a probe
    function's name appears when rendered with it (cached per template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return False
    hit = _RENDERS_TOOLS.get(template)
    if hit is None:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL],
                                                 add_generation_prompt=True, tokenize=False)
            hit = "splitserve_probe_function" in text
        except Exception:
            hit = False
        if len(_RENDERS_TOOLS) > 16:
            _RENDERS_TOOLS.clear()
        _RENDERS_TOOLS[template] = hit
    return hit


_RENDERS_TOOLS: dict[str, bool] = {}


def tokenize(tokenizer, text: Optional[str], messages: Optional[tuple[dict, ...]], tools=None) -> list[int]:
    if messages is None:
        return list(tokenizer.encode(text))
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **template_tools(tools))
    except Exception as e:  # jinja TemplateError raised by the template itself ("roles must alternate")
        raise InvalidRequest(f"the chat template refused these messages: {e}", "messages") from None
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def render(tokenizer, messages: tuple[dict, ...], tools=None) -> str:
    """The text the chat template makes of ``messages`` (what :func:`tokenize` then tokenizes)."""
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                             **template_tools(tools))
    except Exception as e:
        raise InvalidRequest(f"the chat template refused these messages: {e}", "messages") from None

