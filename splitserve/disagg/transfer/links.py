"""Receiving links: the decode worker's KV pool opened to each writer separately, so that one
writer can be *fenced* without touching the others.

A write already handed to the transport cannot be recalled by its writer (a partition may hold its
bytes and deliver them when it heals): only the receiver can make sure nothing more lands, by
closing its end. A decode worker therefore opens one link (a backend instance of its own on the
same pool tensor) per writer incarnation and gives that writer the link's metadata
(``RegisterPeer``). Closing the link is the fence — for NIXL it destroys the link's UCX worker (the
writer sees ``NIXL_ERR_REMOTE_DISCONNECT``), for tcp it stops the link's receiver thread — and
when :meth:`ReceiveLinks.close` returns, nothing written through that link can land any more, so
the pages it could reach may be reused (``docs/design.md``, rule 6).

Receiving links never offer UCX's shared-memory transports (a same-host writer would copy from its
own process, and closing our end would not stop it): unless the operator set ``UCX_TLS`` (then a
warning says what it costs), decode runs UCX with ``UCX_TLS=^sm`` before its first link (the
backend class's ``prepare_receiver``, ``nixl.keep_ucx_off_shared_memory``).

Thread-safe: the control thread opens links, the engine loop closes them (synchronously, before it
reuses a page), the transfer thread polls their notifications.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Hashable, Optional

import torch

from .base import TransferBackend, create_backend, get_backend

log = logging.getLogger(__name__)

class ReceiveLinks:
    """``page_nbytes``: the pool's page size; a tcp link then takes writes only into the pages
    :meth:`allow` gave its writer (the target pages of that writer's registered rooms), NIXL's
    into any page of the pool (``docs/security.md``)."""

    def __init__(self, backend: str, agent_prefix: str, buffer: torch.Tensor, page_nbytes: Optional[int] = None,
                 **opts: Any):
        kind = get_backend(backend)
        kind.prepare_receiver()
        opts = {**opts, **kind.receiver_options(page_nbytes)}
        self._backend, self._prefix, self._buffer, self._opts = backend, agent_prefix, buffer, opts
        self._links: dict[Hashable, TransferBackend] = {}
        self._writer_of: dict[Hashable, Hashable] = {}  # room -> the writer whose link its pages are open on
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self.fenced = 0
        """Links closed so far (for metrics and tests)."""

    def open(self, writer: Hashable) -> tuple[str, bytes]:
        """The agent name and metadata ``writer`` uses to write into our pool (a new link, or the one
        it has)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the receiving links are closed")
            link = self._links.get(writer)
            if link is None:
                name = f"{self._prefix}-link{next(self._ids)}"
                link = self._links[writer] = create_backend(self._backend, name, self._buffer, **self._opts)
                log.info("receiving link %s opened for %s", name, writer)
            return link.agent_name, link.metadata()

    def allow(self, writer: Hashable, room: Hashable, pages) -> None:
        """Open ``pages`` of the pool to ``writer``'s link for ``room`` (before its registration is
        sent: prefill writes once it has it). No link (fenced already): nothing can land, nothing to open."""
        with self._lock:
            link = self._links.get(writer)
            if link is not None:
                self._writer_of[room] = writer
                link.allow_pages(room, pages)

    def revoke(self, room: Hashable, pages=None) -> None:
        """Close ``room``'s pages (``pages`` only, or all) to the writer they were opened to: its
        KV has come, or the pages leave the room. A no-op for a room never allowed."""
        with self._lock:
            writer = self._writer_of.get(room) if pages is not None else self._writer_of.pop(room, None)
            link = self._links.get(writer) if writer is not None else None
            if link is not None:
                link.revoke_pages(room, pages)

    def close(self, writer: Hashable) -> bool:
        """Fence ``writer``: when this returns, nothing it wrote can land any more. False if it had
        no link."""
        with self._lock:
            link = self._links.pop(writer, None)
            if link is None:
                return False
            for room in [r for r, w in self._writer_of.items() if w == writer]:
                del self._writer_of[room]
            link.close()
            self.fenced += 1
        log.info("receiving link %s for %s closed: its writes are fenced", link.agent_name, writer)
        return True

    def expecting(self) -> bool:
        """Some room's pages are open to a writer: its writes and its ``KVDone`` may come now, and
        the links must be polled for them (any thread)."""
        return bool(self._writer_of)

    def notifications(self) -> list[tuple[Hashable, str, bytes]]:
        """``(writer, writer's agent name, notif)`` received on any link since the last call."""
        with self._lock:
            return [(writer, agent, msg) for writer, link in self._links.items()
                    for agent, msg in link.notifications()]

    def writers(self) -> list[Hashable]:
        with self._lock:
            return list(self._links)

    def close_all(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
            self._writer_of.clear()
        for link in links:
            link.close()
