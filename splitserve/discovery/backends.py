"""The discovery backends by URL scheme: the one list ``--discovery`` is read against, and what a
backend provides.

A backend (:class:`Backend`) keeps one value per worker id in a store the URL names: a worker's
:class:`Registrar` keeps its own value there while it serves, a router's :class:`Watcher` lists
them all and says when the store cannot be listed. What a value says is sealed and opened here,
never by a backend: :func:`register` hands the registrar the bytes to keep (the worker's record,
sealed with the cluster secret's record key when it has one: ``signing.py``), and :func:`watch`
hands the watcher a ``read`` that makes a record of a value or raises (:func:`read_values` reads
a whole list with it). So a new store is one module holding a :class:`Backend` and one line in
:data:`BACKENDS`; the seal, the record's validation and the router's handling of what is listed
stay as they are.
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable, Mapping, Protocol, Union
from urllib.parse import urlsplit

from splitserve.discovery.record import one_form, printable_ascii

BACKENDS: Mapping[str, Union[str, type]] = {
    "etcd": "splitserve.discovery.etcd:EtcdBackend",
    "etcds": "splitserve.discovery.etcd:EtcdBackend",
}
"""URL scheme -> ``module:class`` of its :class:`Backend` (imported when used, so a store's client
library is loaded only where it is named), or the class itself."""


class Registrar(Protocol):
    """A worker's value kept in the store while it serves (refreshed from a thread of its own)."""

    registered: threading.Event  # set while the value is in the store, as far as the last call knew

    def start(self) -> "Registrar": ...

    def revoke(self) -> bool:
        """Stop keeping the value and remove it; whether the store said so."""


class Watcher(Protocol):
    """A router's view of the store: ``on_records(records, invalid)`` after every list (``invalid``:
    (key, why) of the values that are no record), ``on_outage(why)`` / ``on_outage(None)`` when
    lists start and stop failing; called from threads of its own."""

    def start(self) -> "Watcher": ...

    def stop(self) -> None: ...


class Backend:
    """A discovery store. ``access``: the ``--discovery-*`` flags' values (``config.DiscoveryConfig``:
    ``ca_certs``, ``certfile``, ``keyfile``, ``user``, ``password_file``)."""

    @classmethod
    def check(cls, url: str, access) -> list[str]:
        """ValueError (naming ``--discovery`` or the flag) for a URL or access this store cannot use;
        else what using it leaves open, said at start."""
        raise NotImplementedError

    @classmethod
    def registrar(cls, url: str, access, record, value: bytes, ttl_s: float) -> Registrar:
        """Keeps ``value`` under ``record.id`` while the worker lives: gone ``ttl_s`` after it stops
        refreshing it (a crash), at once on ``revoke``. Not started."""
        raise NotImplementedError

    @classmethod
    def watcher(cls, url: str, access, read: Callable, on_records: Callable, on_outage: Callable) -> Watcher:
        """Lists the values, each made a record by ``read`` (:func:`read_values`), at every change
        and at least every second or so. Not started."""
        raise NotImplementedError


MAX_URL_CHARS = 1024
"""The longest ``--discovery`` URL taken (its host at most :data:`MAX_HOST_CHARS`)."""
MAX_HOST_CHARS = 253  # DNS's longest name
SHOWN_CHARS = 80  # of a refused URL, echoed in its refusal


def shown(url: str) -> str:
    """``url`` as a refusal echoes it: its first :data:`SHOWN_CHARS` characters, and its length
    when it is longer."""
    return repr(url) if len(url) <= SHOWN_CHARS else f"{url[:SHOWN_CHARS]!r}... ({len(url)} characters)"


def check_url(url: object, backends: Mapping[str, Union[str, type]] = BACKENDS) -> str:
    """``url`` when it is a well-formed ``--discovery`` URL of a known store, ``SCHEME://HOST...``:
    at most :data:`MAX_URL_CHARS` printable ASCII characters, a scheme of ``backends``, its host a
    DNS name of at most :data:`MAX_HOST_CHARS` or an IP address (a worker URL's rules:
    ``record.one_form``), its port (if any) a number; else ValueError naming ``--discovery`` and
    echoing at most :func:`shown` of it. What the rest may hold is the store's to say
    (``Backend.check``)."""
    if not isinstance(url, str) or not url:
        raise ValueError("--discovery: empty; give the store's URL (etcd://HOST:PORT/PREFIX) or leave the flag out")
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"--discovery: {shown(url)} is longer than {MAX_URL_CHARS} characters")
    if not printable_ascii(url):  # urlsplit drops tab, CR and LF before anything could see them
        raise ValueError(f"--discovery: {shown(url)} is not printable ASCII without spaces")
    if scheme_of(url) not in backends:
        raise ValueError(f"--discovery: {shown(url)} names no known discovery store; its scheme must be one of "
                         f"{', '.join(s + '://' for s in backends)}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is no number
    except ValueError:
        parts = None
    host = parts.hostname if parts is not None else None
    if not host:
        raise ValueError(f"--discovery: {shown(url)} is not SCHEME://HOST[:PORT]/... (etcd://HOST:PORT/PREFIX)")
    if len(host) > MAX_HOST_CHARS:
        raise ValueError(f"--discovery: the host of {shown(url)} is {len(host)} characters; a host name is at "
                         f"most {MAX_HOST_CHARS}")
    if one_form(host, bracketed="[" in parts.netloc) is None:
        raise ValueError(f"--discovery: the host of {shown(url)} is no DNS name or IP address (brackets for "
                         "IPv6, no zone id)")
    return url


ACCESS_FIELDS = ("ca_certs", "certfile", "keyfile", "user", "password_file")  # config.DiscoveryConfig's


def check_access(access) -> None:
    """ValueError naming a ``--discovery-*`` flag given empty (``access``: ``config.DiscoveryConfig``):
    a mistake, never taken as the flag left out (an empty ``--discovery-ca-certs`` would quietly mean
    no TLS)."""
    for name in ACCESS_FIELDS:
        if getattr(access, name, None) == "":
            raise ValueError(f"--discovery-{name.replace('_', '-')}: empty; give a value or leave the flag out")


def scheme_of(url: str) -> str:
    """``url``'s scheme in lower case (as ``urlsplit`` reads it); empty when it names none."""
    return url.split(":", 1)[0].lower() if ":" in url else ""


def backend_for(url: str, backends: Mapping[str, Union[str, type]] = BACKENDS) -> type:
    """The :class:`Backend` of ``url``'s scheme; ValueError for a URL :func:`check_url` refuses
    (an unknown scheme: listing the known ones)."""
    found = backends[scheme_of(check_url(url, backends))]
    if isinstance(found, str):
        module, name = found.split(":")
        found = getattr(importlib.import_module(module), name)
    return found


def check(url: str, access, backends: Mapping[str, Union[str, type]] = BACKENDS) -> list[str]:
    """ValueError for a ``--discovery`` (and its access) no backend can use; else the warnings its
    backend has for it."""
    found = backend_for(url, backends)
    check_access(access)
    return found.check(url, access)


def register(url: str, access, record, ttl_s: float, seal,
             backends: Mapping[str, Union[str, type]] = BACKENDS) -> Registrar:
    """``record`` kept in the store of ``url``, sealed with ``seal`` (``signing.RecordSeal``): started."""
    return backend_for(url, backends).registrar(url, access, record, seal.seal(record), ttl_s).start()


def watch(url: str, access, seal, on_records: Callable, on_outage: Callable,
          backends: Mapping[str, Union[str, type]] = BACKENDS) -> Watcher:
    """The store of ``url`` watched, every value opened with ``seal`` (``signing.RecordSeal``): started."""
    return backend_for(url, backends).watcher(url, access, seal.open, on_records, on_outage).start()


def read_values(values, read: Callable, key_of: Callable[[str], str]) -> tuple[list, list]:
    """``(records, invalid)`` of ``values``, (key, value) pairs as a store lists them: each value
    made a record by ``read`` and kept only under ``key_of(record.id)``; whatever reading one raises
    makes it invalid, with why (``invalid``: (key, why), both cut short)."""
    records, invalid = [], []
    for key, value in values:
        try:
            record = read(value)
            if key != key_of(record.id):
                raise ValueError(f"its key is not {key_of('ID')} for its id {record.id!r}")
            records.append(record)
        except Exception as exc:  # ValueError, or whatever else a hostile value makes a parser raise
            invalid.append((key[:200], f"{'' if isinstance(exc, ValueError) else type(exc).__name__ + ': '}"
                                       f"{exc}"[:300]))
    return records, invalid
