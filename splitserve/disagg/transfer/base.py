"""The KV transfer interface: one-sided WRITEs of byte spans of a registered pool, with notifications.

A worker's KV pool is ONE page-major tensor (``engine/kv_pool.py``), so a page of all layers is one
contiguous span and consecutive page ids are one span too. A backend registers that tensor once at
construction; a transfer is a list of :class:`Span` (local offset, remote offset, length), built by
:func:`page_spans`, which merges runs of pages that are consecutive on *both* sides so that a
request's KV crosses in few descriptors.

Roles. The prefill worker is the writer: it learns the decode worker's :meth:`~TransferBackend.metadata`
through the handshake, calls :meth:`~TransferBackend.add_peer`, then :meth:`~TransferBackend.write`
spans into the decode worker's pool and :meth:`~TransferBackend.poll` s the returned handle. The
decode worker only receives: it reads :meth:`~TransferBackend.notifications` to learn that bytes
have landed. Peers are named by their agent name, which carries the process incarnation;
notifications name the *writer's* agent name.

The contract every backend keeps — a write's notification after its bytes, no order between
writes, ``write`` and ``poll`` never raising for transfer errors (FAILED with a reason and
``may_land``), bytes on the wire that a release does not recall, one driving thread — is written
out in ``docs/protocol.md``, *Transfer backends*.
"""

from __future__ import annotations

import enum
import importlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import msgpack
import torch

from splitserve.transfer_backends import BACKENDS

METADATA_VERSION = 1


@dataclass(frozen=True)
class Span:
    """``nbytes`` bytes from ``local_offset`` of our pool to ``remote_offset`` of the peer's pool."""

    local_offset: int
    remote_offset: int
    nbytes: int


def page_spans(local_pages: Sequence[int], remote_pages: Sequence[int], page_nbytes: int) -> list[Span]:
    """Spans that copy ``local_pages[i]`` to ``remote_pages[i]`` for every i, in order.

    A run of pages becomes one span when its ids are consecutive on BOTH sides; a break on either
    side starts a new span. ``page_spans([3, 4, 5, 9], [10, 11, 20, 21], P)`` is
    ``[Span(3P, 10P, 2P), Span(5P, 20P, P), Span(9P, 21P, P)]``.
    """
    if len(local_pages) != len(remote_pages):
        raise ValueError(f"page lists differ in length: {len(local_pages)} local, {len(remote_pages)} remote")
    if page_nbytes <= 0:
        raise ValueError(f"page_nbytes must be positive, got {page_nbytes}")
    spans: list[Span] = []
    run_local = run_remote = run_len = 0
    for lp, rp in zip(local_pages, remote_pages):
        if lp < 0 or rp < 0:
            raise ValueError(f"negative page id in ({lp}, {rp})")
        if run_len and lp == run_local + run_len and rp == run_remote + run_len:
            run_len += 1
            continue
        if run_len:
            spans.append(Span(run_local * page_nbytes, run_remote * page_nbytes, run_len * page_nbytes))
        run_local, run_remote, run_len = lp, rp, 1
    if run_len:
        spans.append(Span(run_local * page_nbytes, run_remote * page_nbytes, run_len * page_nbytes))
    return spans


class Status(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferState:
    """What :meth:`TransferBackend.poll` says about a write; ``reason`` is set when FAILED.
    ``may_land``: a FAILED write whose bytes may still reach the peer (it was handed to the
    network, and nothing proves it was stopped): only the receiver's fence can settle it."""

    status: Status
    reason: str = ""
    may_land: bool = False

    @property
    def pending(self) -> bool:
        return self.status is Status.PENDING

    @property
    def done(self) -> bool:
        return self.status is Status.DONE

    @property
    def failed(self) -> bool:
        return self.status is Status.FAILED

    def __str__(self) -> str:
        return f"FAILED({self.reason})" if self.failed else self.status.name


PENDING = TransferState(Status.PENDING)
DONE = TransferState(Status.DONE)


def failed(reason: str) -> TransferState:
    """A write that failed after it was handed to the network: its bytes may still land."""
    return TransferState(Status.FAILED, reason, may_land=True)


def refused(reason: str) -> TransferState:
    """A write that failed with nothing of it on the network (refused before it was posted, or
    finished by the receiver, which answered): nothing of it can land any more."""
    return TransferState(Status.FAILED, reason, may_land=False)


_handle_ids = itertools.count(1)


@dataclass(eq=False)
class Handle:
    """One write in flight. Backends subclass it to keep their own state; callers read these fields
    (for metrics: KV bytes, descriptors per transfer) and pass the handle back to poll/release."""

    peer: str
    nbytes: int
    num_descs: int
    state: TransferState = PENDING
    released: bool = False
    id: int = field(default_factory=lambda: next(_handle_ids))


class TransferBackend(ABC):
    """A registered KV pool that can write spans of itself into peers' pools (see module docstring).

    ``buffer`` is the whole pool tensor, contiguous; it is registered once here and must outlive the
    backend. Not thread-safe: call every method from one transfer thread.
    """

    name: ClassVar[str]

    def __init__(self, agent_name: str, buffer: torch.Tensor, **opts: Any):
        if not agent_name:
            raise ValueError("agent_name must be non-empty")
        if not buffer.is_contiguous():
            raise ValueError("the KV buffer must be one contiguous tensor")
        self.agent_name = agent_name
        self.buffer = buffer
        self.nbytes = buffer.numel() * buffer.element_size()

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to write into us: agent name, backend, pool size, connection info."""

    @abstractmethod
    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        """Make ``peer_name`` writable. Idempotent for the same metadata; a different metadata under
        a known name is refused (ValueError): a new incarnation must use a new name."""

    def _check_new_peer(self, peer_name: str, metadata: bytes, known: Optional[bytes]) -> Optional[dict]:
        """The checks every ``add_peer`` starts with: the backend is open, and one name is one
        incarnation (``known``: the metadata the name was added with; the same again is a no-op and
        gives None). Returns the decoded metadata of a new peer."""
        if self._closed:
            raise RuntimeError(f"transfer backend {self.agent_name!r} is closed")
        if known is not None:
            if known != metadata:
                raise ValueError(f"peer {peer_name!r} is known with other metadata; a new incarnation needs a new name")
            return None
        return decode_metadata(metadata, self.name, peer_name)

    @abstractmethod
    def remove_peer(self, peer_name: str) -> None:
        """Forget a peer; its pending writes become FAILED(peer_removed). Unknown names are a no-op."""

    # -- what a worker builds this backend with (class hooks: the worker asks before it has one) --

    @classmethod
    def options(cls, host: str, secret: Any) -> dict:
        """Keyword arguments a worker builds this backend with beyond its name and pool, given the
        address it advertises and its cluster secret (tcp: where it listens, CURVE); none here."""
        return {}

    @classmethod
    def prepare_receiver(cls) -> None:
        """Set the process up before its first receiving link (``links.py``; NIXL: UCX off shared
        memory, which closing a link cannot fence). Nothing here."""

    @classmethod
    def receiver_options(cls, page_nbytes: Optional[int]) -> dict:
        """A receiving link's extra keyword arguments, for a pool of pages of ``page_nbytes``
        (tcp: refuse every byte outside the pages a writer was allowed). None here: NIXL's
        one-sided writes reach the whole registered pool whatever the receiver says."""
        return {}

    @abstractmethod
    def write(self, peer_name: str, spans: Sequence[Span], notif: bytes) -> Handle:
        """Start writing ``spans`` into the peer, then deliver ``notif`` to it. Never blocks on the
        network; never raises for a bad request (the handle polls FAILED with the reason)."""

    @abstractmethod
    def poll(self, handle: Handle) -> TransferState:
        """PENDING, DONE or FAILED(reason). Terminal states stick. Never raises for transfer errors."""

    @abstractmethod
    def release(self, handle: Handle) -> None:
        """Free the handle; a pending write is aborted where the backend allows. Idempotent."""

    @abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """``(writer agent name, notif)`` received since the last call, in arrival order per writer."""

    def allow_pages(self, key: object, pages: Sequence[int]) -> None:
        """As a receiving link (``links.py``): let writes land in ``pages`` (page ids of the pool)
        on behalf of ``key`` (a room). A backend that can refuse writes outside the pages it was
        given does (tcp, built with ``writable_page_nbytes``); NIXL's one-sided writes reach the whole
        registered pool whatever the receiver says: there this is a no-op."""

    def revoke_pages(self, key: object, pages: Optional[Sequence[int]] = None) -> None:
        """Take back what :meth:`allow_pages` gave ``key`` (its ``pages`` only, or all); when it
        returns, no write into them lands any more (where the backend can refuse writes)."""

    @abstractmethod
    def close(self) -> None:
        """Release every handle, forget every peer, deregister the pool. Idempotent. When it
        returns, nothing any peer writes to this backend lands in the pool (the fence that
        ``links.py`` relies on)."""

    # -- helpers shared by the backends -------------------------------------------------------

    def _refusal(self, peer_name: str, spans: Sequence[Span], peer_nbytes: Optional[int]) -> Optional[str]:
        """Why every backend refuses a write at once (closed; ``peer_nbytes`` None: the peer is not
        known; spans out of either pool), or None."""
        if self._closed:
            return "closed"
        if peer_nbytes is None:
            return f"unknown_peer: {peer_name!r}"
        return self._bad_spans(spans, peer_nbytes)

    def _bad_spans(self, spans: Sequence[Span], remote_nbytes: int) -> Optional[str]:
        """Why ``spans`` cannot be written (a reason string), or None when they are in bounds."""
        for s in spans:
            if not isinstance(s, Span):
                return f"bad_span: {s!r} is not a Span"
            if s.nbytes <= 0 or s.local_offset < 0 or s.remote_offset < 0:
                return f"bad_span: {s} has a negative offset or no bytes"
            if s.local_offset + s.nbytes > self.nbytes:
                return f"bad_span: {s} ends past the local buffer ({self.nbytes} B)"
            if s.remote_offset + s.nbytes > remote_nbytes:
                return f"bad_span: {s} ends past the peer's buffer ({remote_nbytes} B)"
        return None

    def _check_handle(self, handle: Handle, cls: type[Handle]) -> None:
        if not isinstance(handle, cls):
            raise TypeError(f"{type(handle).__name__} is not a handle of the {self.name} backend")

    def __enter__(self) -> "TransferBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.agent_name!r}, {self.nbytes} B)"


# -- metadata codec: one msgpack map, common fields checked here, backend fields passed through --


def encode_metadata(backend: str, agent_name: str, nbytes: int, **extra: Any) -> bytes:
    return msgpack.packb(
        {"version": METADATA_VERSION, "backend": backend, "agent": agent_name, "nbytes": nbytes, **extra},
        use_bin_type=True,
    )


def decode_metadata(data: bytes, backend: str, peer_name: str) -> dict[str, Any]:
    """Decode a peer's metadata and check it is for ``backend`` and names ``peer_name``."""
    try:
        md = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ValueError(f"peer {peer_name!r}: undecodable transfer metadata ({e})") from e
    if not isinstance(md, dict):
        raise ValueError(f"peer {peer_name!r}: transfer metadata is not a map")
    if md.get("version") != METADATA_VERSION:
        raise ValueError(f"peer {peer_name!r}: metadata version {md.get('version')!r}, expected {METADATA_VERSION}")
    if md.get("backend") != backend:
        raise ValueError(f"peer {peer_name!r}: transfer backend is {md.get('backend')!r}, ours is {backend!r}")
    if md.get("agent") != peer_name:
        raise ValueError(f"peer {peer_name!r}: metadata names agent {md.get('agent')!r}")
    if not isinstance(md.get("nbytes"), int) or md["nbytes"] < 0:
        raise ValueError(f"peer {peer_name!r}: bad pool size {md.get('nbytes')!r}")
    return md


# -- registry with lazy imports: a machine without nixl can still use tcp -----------------------

def backend_names() -> list[str]:
    return list(BACKENDS)


def get_backend(name: str) -> type[TransferBackend]:
    """The backend class registered as ``name``; importing it only now."""
    try:
        module, cls = BACKENDS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown transfer backend {name!r}; known: {', '.join(BACKENDS)}") from None
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ImportError(f"transfer backend {name!r} is not available here: {e}") from e


def create_backend(name: str, agent_name: str, buffer: torch.Tensor, **opts: Any) -> TransferBackend:
    return get_backend(name)(agent_name, buffer, **opts)
