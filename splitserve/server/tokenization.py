"""``POST /tokenize`` and ``POST /detokenize`` on a worker, in vLLM's shape (its serving_tokenization).

Tokenize takes ``{"model", "prompt": str}`` or ``{"model", "messages": [...]}`` (rendered by the
chat template, as ``/v1/chat/completions`` does, with the ``tools`` it is given: the same prompt
tokens a chat request with those tools counts), with ``add_special_tokens`` (default true for a
prompt, false for messages: the template writes its own), ``add_generation_prompt`` (messages
only, default true) and ``return_token_strs`` (default false), and answers
``{"tokens": [...], "count": n, "max_model_len": context}`` (and ``"token_strs"`` when asked).
Detokenize takes ``{"model", "tokens": [...]}`` and answers ``{"prompt": text}``.

Bounded like a generation request (``docs/security.md``, "One request's input"): the body by
``--max-body-bytes``; a text that cannot fit the model's context in tokens is refused by its
length in characters before it is tokenized (``validation.max_chars_per_token``), and one that
turns out longer than the context after it is refused too; ``tokens`` holds at most the context's
number of ids, each an int in the vocabulary. Validation and tokenization run in the worker's
tokenize lanes (``tokenize_lanes.py``), never on the event loop or the engine loop. Both need the
client key (``auth.WORKER_ROUTES``); the router forwards them to a healthy worker.
"""

from __future__ import annotations

from typing import Any, Optional

from splitserve.engine.grammar import parse_tools
from splitserve.engine.io import InvalidRequest
from splitserve.validation.body import check_fields, check_model, check_text, parse_json_body
from splitserve.validation.messages import check_messages
from splitserve.validation.template import renders_tools, template_tools
from splitserve.validation.values import opt, token_ids, type_name
from splitserve.validation_fields import KNOWN



def _check(body: Any, known: frozenset, served_model_name: Optional[str]) -> dict:
    if not isinstance(body, dict):
        body = parse_json_body(body)
    check_text(body)
    check_fields(body, known, "")
    check_model(body, served_model_name)
    return body


def tokenize(body: Any, tokenizer, *, served_model_name: Optional[str], max_context: int,
             chars_per_token: Optional[int]) -> dict:
    """The answer to a ``/tokenize`` body, or InvalidRequest naming the field."""
    body = _check(body, KNOWN["tokenize"], served_model_name)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", "prompt")
    generation_prompt = opt(body, "add_generation_prompt", "", bool)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidRequest(f"prompt must be a string, not {type_name(prompt)}", "prompt")
        for key in ("add_generation_prompt", "tools"):
            if body.get(key) is not None:
                raise InvalidRequest(f"{key} is for messages", key)
        text, param, special = prompt, "prompt", opt(body, "add_special_tokens", "", bool)
        special = True if special is None else special
    else:
        rendered = check_messages(messages)
        tools = parse_tools(body.get("tools"), None, None)
        if tools is not None and not renders_tools(tokenizer):
            raise InvalidRequest("this model's chat template does not render tools; serve it with --chat-template "
                                 "FILE, a template that does", "tools")
        param, special = "messages", bool(opt(body, "add_special_tokens", "", bool))
        try:
            text = tokenizer.apply_chat_template(list(rendered), tokenize=False,
                                                 add_generation_prompt=generation_prompt is not False,
                                                 **template_tools(tools))
        except Exception as e:  # the template's own refusal ("roles must alternate")
            raise InvalidRequest(f"the chat template refused these messages: {e}", "messages") from None
    if chars_per_token and -(-len(text) // chars_per_token) > max_context:
        raise InvalidRequest(f"{param} has {len(text)} characters, at least {-(-len(text) // chars_per_token)} "
                             f"tokens (no token of this model stands for more than {chars_per_token}), "
                             f"but the model's context is {max_context}", param)
    ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=special)]
    if len(ids) > max_context:
        raise InvalidRequest(f"{param} has {len(ids)} tokens, but the model's context is {max_context}", param)
    answer = {"count": len(ids), "max_model_len": max_context, "tokens": ids}
    if opt(body, "return_token_strs", "", bool):
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return answer


def detokenize(body: Any, tokenizer, *, served_model_name: Optional[str], max_context: int, vocab_size: int) -> dict:
    """The answer to a ``/detokenize`` body, or InvalidRequest naming the field."""
    body = _check(body, KNOWN["detokenize"], served_model_name)
    if body.get("tokens") is None:
        raise InvalidRequest("tokens is required", "tokens")
    ids = token_ids(body["tokens"], "tokens", vocab_size, allow_empty=True, max_count=max_context)
    try:
        return {"prompt": tokenizer.decode(ids)}
    except Exception as e:  # an id of the model's vocabulary the tokenizer has no text for
        raise InvalidRequest(f"tokens cannot be decoded: {type(e).__name__}: {e}", "tokens") from None
