"""The prompt of a request: as given (text, token ids or a chat's messages), then tokenized with
the worker's tokenizer and fitted with ``max_tokens`` into the model's context."""

from __future__ import annotations

from typing import Any, Optional

from splitserve.engine.io import DEFAULT_MAX_TOKENS, InvalidRequest
from splitserve.validation.messages import check_messages
from splitserve.validation.template import render, renders_tools, tokenize
from splitserve.validation.values import token_ids, type_name
from splitserve.validation_fields import ABSENT


def prompt(body: dict, endpoint: str, tools, tokenizer, vocab_size: Optional[int]) \
        -> tuple[Optional[str], Optional[list[int]], Optional[tuple[dict, ...]]]:
    """The prompt as given: its text, its token ids or the chat's messages."""
    if endpoint == "completions":
        return (*_completion_prompt(body.get("prompt", ABSENT), vocab_size), None)
    if endpoint == "generate":
        return (*_generate_prompt(body, vocab_size), None)
    messages = check_messages(body.get("messages", ABSENT))
    if tools is not None and tools.parses and tokenizer is not None and not renders_tools(tokenizer):
        raise InvalidRequest("this model's chat template does not render tools, so the model would never see "
                             "them; serve it with --chat-template FILE, a template that does", "tools")
    return None, None, messages


def fit_prompt(text: Optional[str], ids: Optional[list[int]], messages: Optional[tuple[dict, ...]], tools,
               max_tokens: Optional[int], param: str, context: Any) -> tuple[Optional[list[int]], int]:
    """The prompt's token ids (tokenized here when ``context`` has a tokenizer) and ``max_tokens``
    as the context leaves it (absent: :data:`DEFAULT_MAX_TOKENS`, lowered to fit); ``param`` names
    the max-tokens field in errors. ``context``: a ``request.RequestContext``."""
    explicit = max_tokens is not None
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    tokenizer, max_context, chars_per_token = context.tokenizer, context.max_context, context.chars_per_token
    if tokenizer is not None and ids is None:
        if chars_per_token and max_context is not None:
            chars = len(text) if messages is None else len(render(tokenizer, messages, tools))
            _fit_context(-(-chars // chars_per_token), max_tokens, explicit, max_context, param,
                         bound=f"{chars} characters, and no token of this model stands for more than {chars_per_token}")
        ids = tokenize(tokenizer, text, messages, tools)
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenization", "messages" if messages else "prompt")
    if ids is not None and max_context is not None:
        max_tokens = _fit_context(len(ids), max_tokens, explicit, max_context, param)
    return ids, max_tokens


def _completion_prompt(v: Any, vocab_size: Optional[int]) -> tuple[Optional[str], Optional[list[int]]]:
    if v is ABSENT or v is None:
        raise InvalidRequest("prompt is required", "prompt")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise InvalidRequest("prompt is empty", "prompt")
        return v, None
    if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
        raise InvalidRequest(f"batched prompts are not supported: send one prompt per request, got {len(v)}",
                             "prompt")
    if isinstance(v, list):
        return None, token_ids(v, "prompt", vocab_size)
    raise InvalidRequest(f"prompt must be a string or a list of token ids, not {type_name(v)}", "prompt")


def _generate_prompt(body: dict, vocab_size: Optional[int]) -> tuple[Optional[str], Optional[list[int]]]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequest("give exactly one of text and input_ids", "text")
    if text is not None:
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, not {type_name(text)} (batches are not supported)",
                                 "text")
        if not text:
            raise InvalidRequest("text is empty", "text")
        return text, None
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise InvalidRequest("input_ids must be one list of token ids (batches are not supported)", "input_ids")
    return None, token_ids(ids, "input_ids", vocab_size)


def _fit_context(n_prompt: int, max_tokens: int, explicit: bool, max_context: int, param: str,
                 bound: Optional[str] = None) -> int:
    """``max_tokens`` as the context leaves it, or InvalidRequest. ``bound``: ``n_prompt`` is a
    lower bound on the prompt's tokens, for the reason it says."""
    if n_prompt + max_tokens <= max_context:
        return max_tokens
    has = f"has {n_prompt} tokens" if bound is None else f"has at least {n_prompt} tokens ({bound})"
    if explicit:
        raise InvalidRequest(f"prompt {has} and {param} is {max_tokens}, but the model's "
                             f"context is {max_context}", param)
    if n_prompt >= max_context:
        raise InvalidRequest(f"prompt {has}, but the model's context is {max_context} "
                             f"(at least one token must be left to generate)", "prompt")
    return max_context - n_prompt

