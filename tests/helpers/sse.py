"""``sse_events``: the events of a ``text/event-stream`` body."""

from __future__ import annotations

import json
from typing import Union

import requests


def sse_events(body: Union[str, bytes, requests.Response], strict: bool = False) -> list:
    """The ``data:`` payloads of an SSE body, JSON-decoded; ``[DONE]`` kept as the string.
    ``body``: the text, its UTF-8 bytes, or a response (read whole). Other lines (comments, other
    fields) are skipped, unless ``strict``: then every event must be one ``data:`` line, events
    separated by blank lines (the worker's own format)."""
    if isinstance(body, requests.Response):
        body = body.content
    text = body.decode() if isinstance(body, bytes) else body
    if strict:
        lines = text.strip().split("\n\n")
        for block in lines:
            assert block.startswith("data: "), block
    else:
        lines = [line.rstrip("\r") for line in text.split("\n") if line.startswith("data: ")]
    events = []
    for line in lines:
        data = line[len("data: "):]
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events
