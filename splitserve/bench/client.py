"""One streaming request to an OpenAI-compatible endpoint, and when each of its events came.

The request asks for ``stream: true`` with ``stream_options.include_usage`` (the token counts come
from the final usage chunk, not from counting events) and, unless told otherwise, ``ignore_eos``
so that every answer has its ``max_tokens`` (vLLM, SGLang and splitserve take it). An event that
carries generated tokens is a completion chunk with ``text`` or a chat chunk with ``content``
(not the chat stream's opening role-only chunk, nor the usage chunk). A request is an error unless
it answered 200, ended with ``data: [DONE]`` and carried no error event; with ``ignore_eos`` also
unless it produced exactly ``max_tokens`` tokens. A server that takes other fields gets them through
``Target.extra_body`` (llama-cpp-python ignores ``ignore_eos`` but takes ``min_tokens``; it sends no
usage chunk, so its tokens are the events that carried text, or ``max_tokens`` where the answer
ended with ``finish_reason: length``: it holds back a token that ends inside a UTF-8 character and
sends it with the next, so its events can be fewer than its tokens).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import aiohttp

from splitserve.bench.stats import Record
from splitserve.bench.workload import Spec


@dataclass(frozen=True)
class Target:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: Optional[str] = None
    ignore_eos: bool = True
    extra_body: Mapping[str, object] = field(default_factory=dict)
    """More fields for every request's body (they override the ones built here)."""


def body_of(spec: Spec, target: Target) -> dict:
    body: dict = {"max_tokens": spec.max_tokens, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": 0}
    if target.model:
        body["model"] = target.model
    if target.ignore_eos:
        body["ignore_eos"] = True
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    body.update(target.extra_body)
    return body


async def send(session: aiohttp.ClientSession, target: Target, spec: Spec,
               clock: Callable[[], float] = time.perf_counter) -> tuple[Record, str]:
    """Send ``spec``; its record (times on ``clock``) and the answer's text (the next turn needs it)."""
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    sent = clock()
    times: list[float] = []
    text: list[str] = []
    usage: dict = {}
    finish: list[Optional[str]] = [None]  # the last finish_reason seen
    done = False

    def record(error: Optional[str] = None, cancelled: bool = False) -> Record:
        counted = spec.max_tokens if finish[0] == "length" else len(times)  # without a usage chunk
        return Record(sent=sent, ended=clock(), token_times=tuple(times),
                      output_tokens=usage.get("completion_tokens", counted),
                      prompt_tokens=usage.get("prompt_tokens", 0), error=error, cancelled=cancelled,
                      session=spec.session, turn=spec.turn)

    try:
        async with session.post(target.url + path, json=body_of(spec, target)) as resp:
            if resp.status != 200:
                return record(f"HTTP {resp.status}: {(await resp.text())[:300]}"), ""
            if spec.cancel_after == 0:
                resp.close()  # hang up now (leaving the block would wait for the rest of the answer)
                return record(cancelled=True), ""
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return record(f"error event: {json.dumps(event['error'])[:300]}"), ""
                piece = _tokens_of(event)
                if piece:
                    times.append(clock())
                    text.append(piece)
                    if spec.cancel_after is not None and len(times) >= spec.cancel_after:
                        resp.close()
                        return record(cancelled=True), ""
                if event.get("usage"):
                    usage = event["usage"]
                finish[0] = _finish_reason(event) or finish[0]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return record(f"{type(exc).__name__}: {exc}"), ""
    rec = record()
    if not done:
        return record("the stream ended without data: [DONE]"), ""
    if not times:
        return record("the answer carried no tokens"), ""
    if target.ignore_eos and rec.output_tokens != spec.max_tokens:
        return record(f"{rec.output_tokens} tokens, asked for {spec.max_tokens} with ignore_eos"), ""
    return rec, "".join(text)


def _finish_reason(event: dict) -> Optional[str]:
    choices = event.get("choices") or ()
    return choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None


def _tokens_of(event: dict) -> str:
    choices = event.get("choices") or ()
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""
