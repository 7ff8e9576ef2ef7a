"""A worker's answer read whole, bounded in bytes as well as in time: whatever answers at a
worker's address cannot make the router hold more of one answer than its reader expects (the
time bound alone lets a fast sender fill the router's memory before it runs out)."""

from __future__ import annotations

import aiohttp

SMALL_ANSWER_BYTES = 1 << 20
"""``/health``, ``/v1/models``, ``/get_server_info``, ``/flush_cache``, an error body."""
LARGE_ANSWER_BYTES = 256 << 20
"""A whole generation (``n`` choices, logprobs), a tokenization, a request's timeline."""


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """A worker's answer ran past the bound its reader set (read as a broken answer)."""


async def read_answer(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """``resp``'s body, or :class:`AnswerTooLarge` as soon as it passes ``limit`` bytes (its
    ``Content-Length`` says so before a byte is read)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise AnswerTooLarge(f"an answer of {resp.content_length} bytes, more than the {limit} read here")
    chunks, size = [], 0
    while chunk := await resp.content.readany():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"an answer of more than the {limit} bytes read here")
        chunks.append(chunk)
    return b"".join(chunks)
