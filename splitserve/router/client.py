"""The client side of a request through the router, bounded: reading its body; its answer is
written by ``splitserve/client_writer.py``.

A client is never trusted to keep its side moving. Every way the router waits on it has a bound
(options of ``splitserve router``, documented in ``docs/router.md``):

- ``client_header_timeout_s``: aiohttp's keep-alive timer, which closes a connection that has not
  sent a whole request head that long after connecting or after its previous answer (set on the
  runner in ``app.py``);
- ``client_body_timeout_s``: :func:`read_body`, the whole body or ``ClientLost`` (408);
- ``client_write_timeout_s``: ``ClientWriter``, each write (headers, a chunk, the end) or
  ``ClientLost``.

A client that goes away shows up as a failed write, or as the cancellation of the handler (the
runner cancels it when the connection is lost), which the exchange treats as its end.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from splitserve.client_writer import ClientLost
from splitserve.http_util import body_too_large, body_unreadable


async def read_body(request: web.Request, timeout: float, limit: int) -> bytes:
    """The whole request body within ``timeout`` seconds, else :class:`ClientLost` (the caller
    answers 408). A body over the app's size limit (``--max-body-bytes``) is a 413 naming it; one
    that cannot be decoded, a 400 (``http_util.body_unreadable``)."""
    try:  # not wait_for: on Python 3.11 it drops a cancellation (the client gone) that comes as the body completes
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limit) from None
    except web.RequestPayloadError:
        raise body_unreadable(request) from None
    except TimeoutError:
        raise ClientLost(f"the request body did not arrive within the router's client_body_timeout_s "
                         f"({timeout:g} s)", timed_out=True) from None
