"""The JSON shapes of the HTTP API: OpenAI completions and chat (whole answers and stream chunks),
SGLang's ``/generate``, and the OpenAI error body. Pure functions of plain values, no I/O, so the
router can build the same shapes.

An answer is accumulated from engine deltas in :class:`Accumulator`; builders take it (or one
delta) and return a dict ready for ``json.dumps``.

Logprobs (when the request asks for them) come in each API's own shape: completions' ``tokens``,
``token_logprobs``, ``top_logprobs`` (token text -> logprob) and ``text_offset``; chat's
``content`` list of ``{token, logprob, bytes, top_logprobs}``; ``/generate``'s ``meta_info``
``output_token_logprobs`` / ``output_top_logprobs`` as ``[logprob, token_id, text or null]``
(SGLang's). Values are the raw model's (``engine/sampler.py``); a logprob of ``-inf`` is written
as ``-9999.0`` (JSON has no infinity; vLLM's convention). Token texts come from
:class:`TokenStrings`.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import Optional

from splitserve.engine.io import RequestOutput, TokenLogprob
from splitserve.errors import engine_error_body, error_body  # noqa: F401 (the error body is the API's too)
from splitserve.outcomes import Reason
from splitserve.server import tool_calls


CLIENT_WORDS: dict[Reason, str] = {
    Reason.INTERNAL_ERROR: "internal error in the worker",
    Reason.PEER_LOST: "the other worker of this split request was lost: it stopped answering, restarted, "
                      "or its connection broke",
    Reason.PEER_FAILED: "the other worker of this split request failed it",
    Reason.TRANSFER_ERROR: "the KV transfer between the prefill and decode workers failed",
    Reason.TRANSFER_TIMEOUT: "the KV transfer between the prefill and decode workers did not finish in time",
    Reason.BOOTSTRAP_TIMEOUT: "the prefill and decode workers of this request did not reach each other in time",
    Reason.INCOMPATIBLE_PEER: "the prefill and decode workers cannot serve together: a setting that must match "
                              "differs, or the cluster secret",
    Reason.CLIENT_ABORT: "the request was aborted by its client, the router or an operator",
}
"""What a client reads of an ending whose detail can name other workers (addresses, transfer
agents, incarnations) or carry exception text, and of an abort, whose detail another party wrote
(``POST /abort_request``: the router names the prefill worker that failed): these words and the
request id. The detail is in the worker's log line of the request's end (``LogTerminal``, or the
logged exception). Every other reason's detail is the client's to read: a bound it hit
(``older than 2s``), its own bad input, a full queue, a draining worker, the peer's reason for
an abort (a reason's name)."""


def internal_error_text(rid: Optional[str]) -> str:
    """What a client reads of a bug that failed its request: no exception text, which can name
    files, addresses or another request's data; the log and ``/debug/requests`` have the detail."""
    return CLIENT_WORDS[Reason.INTERNAL_ERROR] + _rid_text(rid)


def client_text(reason: Reason, rid: Optional[str]) -> str:
    """``reason: words (request id X)`` for a reason of :data:`CLIENT_WORDS` (a bug's own form for
    ``internal_error``)."""
    if reason is Reason.INTERNAL_ERROR:
        return internal_error_text(rid)
    return f"{reason.value}: {CLIENT_WORDS[reason]}" + _rid_text(rid)


def _rid_text(rid: Optional[str]) -> str:
    return f" (request id {rid})" if rid else ""


def ended_error_body(out: RequestOutput) -> dict:
    """The error body of a request that failed or was aborted: its reason is the code; the message
    is the ending's own (``reason: detail``), or words by reason (:data:`CLIENT_WORDS`)."""
    code = out.reason.value if out.reason is not None else None
    if out.reason in CLIENT_WORDS:
        return error_body(client_text(out.reason, out.rid), out.status, code=code)
    return error_body(out.error or "the engine ended the request without an answer", out.status, code=code)


@dataclass
class Accumulator:
    """A request's answer so far, built from its engine deltas: choice 0 in its own fields, the
    others (``n`` > 1) in ``choices``; ``done`` once the request's last delta came."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[RequestOutput] = None  # the failed last delta, if any
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    token_gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive deltas that carried tokens (the inter-token latencies)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per token of ``token_ids`` when the request asked for logprobs."""
    prompt_logprobs: tuple = ()
    """One per prompt token (None for the first) when the request asked for them."""
    choices: dict = field(default_factory=dict)
    """index -> Accumulator of choice index > 0."""
    done: bool = False
    carried: int = 0
    """Completion tokens of choices this worker did not generate (a continuation's finished ones)."""

    def choice(self, index: int) -> "Accumulator":
        if index == 0:
            return self
        if index not in self.choices:
            self.choices[index] = Accumulator()
        return self.choices[index]

    def choice_list(self) -> list[tuple[int, "Accumulator"]]:
        return [(0, self)] + sorted(self.choices.items())

    @property
    def total_completion_tokens(self) -> int:
        return self.carried + self.completion_tokens + sum(c.completion_tokens for c in self.choices.values())

    def add(self, out: RequestOutput) -> None:
        if out.finished:
            self.done = True
        if out.index and out.error is None:
            if out.token_ids:
                self._timed()
            self.choice(out.index)._add(out)
            return
        if out.token_ids:
            self._timed()
        self._add(out)

    def _timed(self) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.token_gaps.append(now - self.last_token_at)
        self.last_token_at = now

    def _add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs:
            self.prompt_logprobs = out.prompt_logprobs
        if out.prompt_tokens:
            self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens, len(self.token_ids))
        if out.error is not None:
            self.error = out
        elif out.finished or out.finish_reason is not None:  # with n > 1 a choice ends before the request
            self.finish_reason = out.finish_reason or "stop"

    @property
    def full_text(self) -> str:
        return "".join(self.text)

    def usage(self) -> dict:
        completion = self.total_completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


# -- logprobs ------------------------------------------------------------------------------------

NEG_INF_LOGPROB = -9999.0
"""What a logprob of ``-inf`` is written as (JSON has no infinity)."""


def _lp(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level alphabet (a byte-level BPE token's characters -> bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def _decodes_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level (GPT-2's alphabet): then a token's string
    spells its bytes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except Exception:
        return False
    return '"ByteLevel"' in json.dumps(decoder)


class TokenStrings:
    """A token id's text (``tokenizer.decode([id])``) and its bytes — its own bytes where the
    tokenizer's vocabulary says them (a byte-level BPE token, a ``<0xNN>`` byte-fallback token;
    a token may be part of one UTF-8 character), else its text's UTF-8 — cached (bounded)."""

    def __init__(self, tokenizer, cache_size: int = 65536):
        self.tokenizer = tokenizer
        self.byte_level = _decodes_byte_level(tokenizer)
        self.text = functools.lru_cache(maxsize=cache_size)(self._text)
        self.bytes = functools.lru_cache(maxsize=cache_size)(self._bytes)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _bytes(self, token: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str) and piece:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return [int(piece[3:5], 16)]
                except ValueError:
                    pass
            if self.byte_level and all(c in _BYTE_DECODER for c in piece):
                return [_BYTE_DECODER[c] for c in piece]
        return list(self.text(token).encode("utf-8"))


def completion_logprobs(strings: TokenStrings, token_ids: list[int], logprobs: list[Optional[TokenLogprob]],
                        offset: int = 0) -> dict:
    """The completions ``logprobs`` object of these tokens; ``offset``: the text offset of the
    first. A token without logprobs (an echoed prompt's first) has null ones."""
    texts = [strings.text(t) for t in token_ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [_lp(lp.logprob) if lp is not None else None for lp in logprobs],
            "top_logprobs": [{strings.text(t): _lp(v) for t, v in lp.top} if lp is not None else None
                             for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(strings: TokenStrings, token_ids: list[int], logprobs: list[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object of these tokens."""
    def entry(t: int, v: float) -> dict:
        return {"token": strings.text(t), "logprob": _lp(v), "bytes": strings.bytes(t)}

    return {"content": [dict(entry(t, lp.logprob), top_logprobs=[entry(a, v) for a, v in lp.top])
                        for t, lp in zip(token_ids, logprobs)], "refusal": None}


def generate_logprobs(strings: Optional[TokenStrings], token_ids: list[int], logprobs: list[TokenLogprob]) -> dict:
    """SGLang's ``meta_info`` logprob fields; ``strings`` None: no token texts (null)."""
    def entry(t: int, v: float) -> list:
        return [_lp(v), t, strings.text(t) if strings is not None else None]

    return {"output_token_logprobs": [entry(t, lp.logprob) for t, lp in zip(token_ids, logprobs)],
            "output_top_logprobs": [[entry(a, v) for a, v in lp.top] for lp in logprobs],
            "input_token_logprobs": [], "input_top_logprobs": []}


def generate_input_logprobs(strings: Optional[TokenStrings], prompt_ids: list[int],
                            logprobs: tuple, start: int) -> dict:
    """SGLang's ``input_token_logprobs`` / ``input_top_logprobs`` of the prompt from token
    ``start``: ``[logprob, id, text]``, the first prompt token's logprob null (and its top)."""
    def entry(t: int, v: Optional[float]) -> list:
        return [_lp(v) if v is not None else None, t, strings.text(t) if strings is not None else None]

    pairs = list(zip(prompt_ids, logprobs))[start:]
    return {"input_token_logprobs": [entry(t, lp.logprob if lp is not None else None) for t, lp in pairs],
            "input_top_logprobs": [[entry(a, v) for a, v in lp.top] if lp is not None else None for _, lp in pairs]}


# -- answers and chunks -------------------------------------------------------------------------


def completion_response(rid: str, model: str, created: int, acc: Accumulator,
                        strings: Optional[TokenStrings] = None, echo: Optional[tuple[str, list[int]]] = None) -> dict:
    """``strings``: give it when the request asked for logprobs; ``echo``: the prompt's text and
    ids, when the answer starts with them."""
    choices = []
    for index, c in acc.choice_list():
        text, ids, lps = c.full_text, list(c.token_ids), list(c.logprobs)
        if echo is not None:
            text, ids = echo[0] + text, list(echo[1]) + ids
            lps = list(acc.prompt_logprobs) + lps
        logprobs = completion_logprobs(strings, ids, lps) if strings is not None else None
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": acc.usage()}


def chat_response(rid: str, model: str, created: int, acc: Accumulator,
                  strings: Optional[TokenStrings] = None, tool_names=None) -> dict:
    """``tool_names``: the request's functions, when its answer's tool calls are parsed
    (``server/tool_calls.py``): then a message may carry ``tool_calls``."""
    choices = []
    for index, c in acc.choice_list():
        message, reason = {"role": "assistant", "content": c.full_text}, c.finish_reason
        if tool_names is not None:
            parser = tool_calls.parse(c.full_text, tool_names)
            message.update(parser.message())
            reason = tool_calls.finish_reason(reason, parser)
        choices.append({"index": index, "message": message,
                        "logprobs": chat_logprobs(strings, c.token_ids, c.logprobs) if strings is not None else None,
                        "finish_reason": reason})
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": acc.usage()}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: Optional[str],
                     logprobs: Optional[dict] = None, index: int = 0) -> dict:
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: Optional[str],
               logprobs: Optional[dict] = None, index: int = 0) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(endpoint: str, rid: str, model: str, created: int, acc: Accumulator) -> dict:
    """The last chunk when ``stream_options.include_usage``: empty ``choices``, the usage."""
    if endpoint == "chat":
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [], "usage": acc.usage()}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [], "usage": acc.usage()}


def generate_meta(rid: str, acc: Accumulator, started: float) -> dict:
    """SGLang's ``meta_info`` of one choice (``acc``'s own, not its other choices');
    ``finish_reason`` is ``{"type": "stop"|"length"}`` (or null)."""
    meta = {"id": rid, "prompt_tokens": acc.prompt_tokens, "completion_tokens": acc.completion_tokens,
            "finish_reason": {"type": acc.finish_reason} if acc.finish_reason else None,
            "e2e_latency": round(time.monotonic() - started, 6)}
    return meta


def generate_response(rid: str, acc: Accumulator, started: float, logprobs: bool = False,
                      strings: Optional[TokenStrings] = None, prompt: Optional[tuple[list[int], int]] = None) -> dict:
    """``logprobs``: the request asked for them (``return_logprob``); ``strings``: name each
    token's text in them (``return_text_in_logprobs``); ``prompt``: its ids and
    ``logprob_start_len``, when the prompt's logprobs were asked for."""
    meta = generate_meta(rid, acc, started)
    if logprobs:
        meta.update(generate_logprobs(strings, acc.token_ids, acc.logprobs))
        if prompt is not None and acc.prompt_logprobs:
            meta.update(generate_input_logprobs(strings, prompt[0], acc.prompt_logprobs, prompt[1]))
    return {"text": acc.full_text, "output_ids": list(acc.token_ids), "meta_info": meta}


def generate_responses(rid: str, acc: Accumulator, started: float, logprobs: bool = False,
                       strings: Optional[TokenStrings] = None, prompt: Optional[tuple[list[int], int]] = None,
                       n: int = 1):
    """The ``/generate`` answer: :func:`generate_response`, or with ``n`` > 1 a list of one per
    choice, in index order (SGLang's shape for ``sampling_params.n``)."""
    if n == 1:
        return generate_response(rid, acc, started, logprobs, strings, prompt)
    return [generate_response(rid, c, started, logprobs, strings, prompt) for _, c in acc.choice_list()]


def generate_chunk(rid: str, acc: Accumulator, started: float, logprobs: bool = False,
                   strings: Optional[TokenStrings] = None, prompt: Optional[tuple[list[int], int]] = None,
                   index: Optional[int] = None) -> dict:
    """A streamed ``/generate`` chunk. As SGLang by default, ``text`` and ``output_ids`` are
    cumulative (the whole answer so far), so a client keeps the last chunk; so are its logprobs.
    ``index``: with ``n`` > 1, the choice it is of (its answer so far, and an ``index`` field, as
    SGLang streams a request of several)."""
    if index is None:
        return generate_response(rid, acc, started, logprobs, strings, prompt)
    return dict(generate_response(rid, acc.choice(index), started, logprobs, strings, prompt), index=index)
