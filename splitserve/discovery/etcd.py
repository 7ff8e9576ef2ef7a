"""Discovery through etcd (the v3 API, over its JSON gateway, with ``etcd3gw``; ``docs/deploy.md``).

``--discovery etcd://HOST:PORT/PREFIX`` (``etcds://`` for TLS): one key per worker id,
``PREFIX/workers/ID``, its value the worker's :class:`~splitserve.discovery.record.WorkerRecord`.

- **A worker** (:class:`Registration`) puts its record under a lease of ``--discovery-ttl-s`` and
  keeps the lease alive from a plain thread of its own (no event loop can starve it), refreshing
  every third of the TTL; an expired lease is granted anew and the record put again, and at every
  refresh the key is read back and put again unless it holds this worker's value under its lease.
  On SIGTERM :meth:`Registration.revoke` revokes the lease first, so routers stop sending new legs.
- **A router** (:class:`Watcher`) lists the prefix, then watches it, and lists again at every change
  and at least every :data:`RELIST_S`: the list is the truth, the watch only makes it prompt. A list
  that fails changes nothing (the known workers stay, health-checked) and is tried again with
  backoff (:data:`BACKOFF_S` doubled to :data:`BACKOFF_MAX_S`); ``splitserve_router_discovery_outage``.

:func:`client` authenticates through the gateway's ``/v3/auth/authenticate`` itself (``etcd3gw``
has no user/password call) and sends the token on every request; :func:`plaintext_password` warns
of a password over plain ``etcd://``. Records are sealed and validated outside this module
(``backends.py``, ``signing.py``); :class:`EtcdBackend` is what ``backends.BACKENDS`` names.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Optional
from urllib.parse import urlsplit

from splitserve.discovery.backends import Backend, read_values, shown

log = logging.getLogger(__name__)

RELIST_S = 1.0  # the longest a change can go unseen while etcd is up (the watch is usually faster)
BACKOFF_S, BACKOFF_MAX_S = 0.5, 8.0
REQUEST_TIMEOUT_S = 5.0  # one call to etcd
MAX_LISTED = 2048  # keys read per list (etcd's range limit): past MAX_DISCOVERED workers and a margin of junk
KEY_DIR = "workers"


@dataclasses.dataclass(frozen=True)
class Target:
    host: str
    port: int
    prefix: str  # no trailing slash, starts with "/"
    tls: bool = False

    @property
    def key_prefix(self) -> str:
        return f"{self.prefix}/{KEY_DIR}/"

    def key(self, worker_id: str) -> str:
        return self.key_prefix + worker_id

    def __str__(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://{self.host}:{self.port}{self.prefix}"


def parse_target(text: str) -> Target:
    """``etcd://HOST:PORT/PREFIX`` (or ``etcds://``); ValueError naming what is wrong."""
    from splitserve.discovery.record import printable_ascii

    if not printable_ascii(text):  # urlsplit drops tab, CR and LF before anything could see them
        raise ValueError(f"--discovery: {shown(text)} is not etcd://HOST:PORT/PREFIX (printable ASCII, no spaces)")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        port, parts = None, None
    if parts is None or parts.scheme not in ("etcd", "etcds") or not parts.hostname or port is None \
            or parts.query or parts.fragment or parts.username:
        raise ValueError(f"--discovery: {shown(text)} is not etcd://HOST:PORT/PREFIX")
    prefix = "/" + parts.path.strip("/")
    if prefix == "/" or any(not seg or seg in (".", "..") for seg in prefix[1:].split("/")):
        raise ValueError(f"--discovery: {shown(text)} needs a prefix (etcd://HOST:PORT/PREFIX), e.g. /splitserve")
    return Target(parts.hostname, port, prefix, parts.scheme == "etcds")


@dataclasses.dataclass(frozen=True)
class Credentials:
    """TLS and auth for etcd, from the ``--discovery-*`` flags."""

    ca_certs: Optional[str] = None
    certfile: Optional[str] = None
    keyfile: Optional[str] = None
    user: Optional[str] = None
    password_file: Optional[str] = None

    @classmethod
    def of(cls, access) -> "Credentials":
        """From ``access`` (``config.DiscoveryConfig``); ValueError for flags that go together alone."""
        creds = cls(access.ca_certs, access.certfile, access.keyfile, access.user, access.password_file)
        if (creds.certfile is None) != (creds.keyfile is None):
            raise ValueError("--discovery-certfile and --discovery-keyfile go together")
        if (creds.user is None) != (creds.password_file is None):
            raise ValueError("--discovery-user and --discovery-password-file go together")
        return creds

    def password(self) -> str:
        try:
            with open(self.password_file, encoding="utf-8") as f:
                lines = f.read(4096).splitlines()
        except OSError as exc:
            raise ValueError(f"--discovery-password-file {self.password_file}: {exc}") from None
        if not lines or not lines[0]:
            raise ValueError(f"--discovery-password-file {self.password_file}: empty")
        return lines[0]


def plaintext_password(target: Target, creds: Credentials) -> Optional[str]:
    """The warning for a user's password sent to etcd without TLS (None when it is not)."""
    if creds.user is None or target.tls or creds.ca_certs or creds.certfile:
        return None
    return (f"--discovery-user {creds.user} over plain {target}: its password, and the token etcd gives for it, "
            "travel in the clear; use etcds:// (or --discovery-ca-certs) unless only this cluster can see that "
            "network")


def client(target: Target, creds: Credentials = Credentials()):
    """An ``etcd3gw`` client for ``target``, authenticated when ``creds`` name a user."""
    import requests
    from etcd3gw.client import Etcd3Client

    session = requests.Session()
    if creds.ca_certs:
        session.verify = creds.ca_certs
    if creds.certfile:
        session.cert = (creds.certfile, creds.keyfile)
    protocol = "https" if target.tls or creds.ca_certs or creds.certfile else "http"
    etcd = Etcd3Client(host=target.host, port=target.port, protocol=protocol, timeout=REQUEST_TIMEOUT_S,
                       api_path="/v3/", session=session)
    if creds.user:
        _authenticate(etcd, creds)
        post = etcd.post

        def post_again_after_refusal(url, *args, **kwargs):
            try:
                return post(url, *args, **kwargs)
            except Exception as exc:  # an expired token: once more with a new one
                if "token" not in str(exc).lower() and "auth" not in str(exc).lower():
                    raise
                _authenticate(etcd, creds)
                return post(url, *args, **kwargs)

        etcd.post = post_again_after_refusal
    return etcd


def _authenticate(etcd, creds: Credentials) -> None:
    etcd.session.headers.pop("Authorization", None)
    answer = etcd.session.post(etcd.get_url("/auth/authenticate"), json={"name": creds.user,
                                                                         "password": creds.password()},
                               timeout=REQUEST_TIMEOUT_S)
    if answer.status_code != 200 or not isinstance(answer.json().get("token"), str):
        raise ConnectionError(f"etcd refused user {creds.user!r}: {answer.status_code} {answer.text[:200]}")
    etcd.session.headers["Authorization"] = answer.json()["token"]


def _key_text(key) -> str:
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)


def worth_logging(count: int) -> bool:
    """The first few and then one in many (``log_sparsely``'s rule: that module is this one's sibling)."""
    return count <= 20 or count % 1000 == 0


def get_prefix(etcd, prefix: str, limit: int) -> list:
    """(value, meta) of the first ``limit`` keys under ``prefix``, by key (etcd's range limit: the
    rest never crosses the network)."""
    return etcd.get(prefix, metadata=True, range_end=prefix[:-1] + chr(ord(prefix[-1]) + 1), limit=limit,
                    sort_order="ascend", sort_target="key")


class Registration:
    """A worker's record in etcd under a lease kept alive by a thread of its own."""

    def __init__(self, target: Target, record, ttl_s: float, creds: Credentials = Credentials(),
                 make_client: Callable = client, value: Optional[bytes] = None):
        self.target, self.record, self.ttl_s, self.creds = target, record, max(2, int(round(ttl_s))), creds
        self.key = target.key(record.id)
        self.make_client = make_client
        self.value = (record.to_json() if value is None else value).decode()  # what is put: sealed, or the bare record
        self.registered = threading.Event()  # the record is in etcd (as far as the last call knew)
        self._stop = threading.Event()
        self._lease = None
        self._etcd = None
        self.restored = 0  # times the key was found without this worker's value, and put again
        self._thread = threading.Thread(target=self._run, name="discovery-keepalive", daemon=True)

    def start(self) -> "Registration":
        self._thread.start()
        return self

    def _run(self) -> None:
        backoff = BACKOFF_S
        while not self._stop.is_set():
            try:
                if self._etcd is None:
                    self._etcd = self.make_client(self.target, self.creds)
                if self._lease is None:
                    self._put()
                elif self._lease.refresh() <= 0:  # the lease expired meanwhile: register again
                    log.warning("discovery: the lease of %s expired; registering again", self.key)
                    self._lease = None
                    continue
                elif not self._holds_own():  # deleted, or overwritten (an old record put back)
                    self.restored += 1
                    if worth_logging(self.restored):
                        log.warning("discovery: %s does not hold this worker's record under its lease (deleted "
                                    "or overwritten); putting it again (%d times so far)", self.key, self.restored)
                    self._etcd.put(self.key, self.value, lease=self._lease)
                if not self.registered.is_set():
                    log.info("discovery: registered %s in %s (lease %.0f s)", self.record.id, self.target, self.ttl_s)
                    self.registered.set()
                backoff = BACKOFF_S
                self._stop.wait(self.ttl_s / 3)
            except Exception as exc:  # etcd unreachable: keep trying, the lease may still be alive
                if self.registered.is_set():
                    log.warning("discovery: cannot reach etcd %s (%s: %s); retrying", self.target,
                                type(exc).__name__, exc)
                self.registered.clear()
                self._stop.wait(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2, self.ttl_s / 3)

    def _holds_own(self) -> bool:
        """Whether the key holds exactly this worker's value, under its lease."""
        found = self._etcd.get(self.key, metadata=True)
        if len(found) != 1:
            return False
        value, meta = found[0]
        value = value.encode() if isinstance(value, str) else value
        return value == self.value.encode() and str(meta.get("lease", "")) == str(self._lease.id)

    def _put(self) -> None:
        lease = self._etcd.lease(ttl=self.ttl_s)
        self._etcd.put(self.key, self.value, lease=lease)
        self._lease = lease

    def revoke(self) -> bool:
        """Stop the keepalive and revoke the lease (its record goes with it); whether etcd said so."""
        self._stop.set()
        self._thread.join(REQUEST_TIMEOUT_S + 1)
        lease, self._lease = self._lease, None
        self.registered.clear()
        if lease is None:
            return False
        try:
            lease.revoke()
            log.info("discovery: revoked the lease of %s", self.key)
            return True
        except Exception as exc:  # it expires by its TTL instead
            log.warning("discovery: could not revoke the lease of %s (%s); it ends within %.0f s", self.key,
                        exc, self.ttl_s)
            return False


class Watcher:
    """A router's view of the prefix: calls ``on_records(records, invalid)`` with every valid
    record after each successful list (``invalid``: (key, why) of the rest), and ``on_outage(why)``
    / ``on_outage(None)`` when lists start and stop failing. Runs in threads of its own; the
    callbacks are called from them (the router hands them to its event loop). ``read`` makes a
    record of a value or raises ValueError (a seal's ``open``: ``signing.py``)."""

    def __init__(self, target: Target, on_records: Callable, on_outage: Callable, creds: Credentials = Credentials(),
                 make_client: Callable = client, read: Optional[Callable] = None):
        from splitserve.discovery.record import parse_record

        self.target, self.creds = target, creds
        self.read = read or parse_record
        self.on_records, self.on_outage = on_records, on_outage
        self.make_client = make_client
        self.changed = threading.Event()
        self._stop = threading.Event()
        self._cancel_watch: Optional[Callable] = None
        self._down: Optional[str] = None  # why the last list failed (None: it did not)
        self.unexpected = 0  # lists whose values could not be applied (a bug, said sparsely)
        self.capped = 0  # lists that met MAX_LISTED
        self._thread = threading.Thread(target=self._run, name="discovery-watch", daemon=True)

    def start(self) -> "Watcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.changed.set()
        self._end_watch()
        self._thread.join(REQUEST_TIMEOUT_S + 1)

    def _run(self) -> None:
        etcd, backoff, self._down = None, BACKOFF_S, None
        while not self._stop.is_set():
            try:
                if etcd is None:
                    etcd = self.make_client(self.target, self.creds)
                self.changed.clear()
                listed = self._list(etcd)
            except Exception as exc:
                self._failed(f"{type(exc).__name__}: {exc}"[:300])
                etcd = None
                self._stop.wait(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)
                continue
            try:
                self._listed(listed)
                if self._cancel_watch is None:
                    self._watch(etcd)
            except Exception as exc:  # a bug here must not end discovery for good: an outage, said sparsely
                self.unexpected += 1
                if worth_logging(self.unexpected):
                    log.exception("discovery: applying a list of %s failed (%d times so far)", self.target,
                                  self.unexpected)
                self._failed(f"{type(exc).__name__}: {exc}"[:300], said=True)
                self._stop.wait(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)
                continue
            backoff = BACKOFF_S
            self.changed.wait(RELIST_S)

    def _list(self, etcd) -> list:
        """At most :data:`MAX_LISTED` (value, meta) of the prefix, by key: the rest is not read at all."""
        listed = get_prefix(etcd, self.target.key_prefix, MAX_LISTED)
        if len(listed) >= MAX_LISTED:
            self.capped += 1
            if worth_logging(self.capped):
                log.warning("discovery: %s holds %d keys or more; only the first %d (by key) are read, the "
                            "workers past them are not seen", self.target, MAX_LISTED, MAX_LISTED)
        return listed

    def _failed(self, why: str, said: bool = False) -> None:
        if self._down is None:
            if not said:
                log.warning("discovery: etcd %s unreachable (%s); keeping the workers known, retrying",
                            self.target, why)
            self.on_outage(why)
        self._down = why
        self._end_watch()

    def _listed(self, listed: list) -> None:
        """Read every value of a list (one that cannot be read is invalid, whatever it raises) and
        hand the records on."""
        if self._down is not None:
            log.info("discovery: etcd %s reachable again", self.target)
            self.on_outage(None)
            self._down = None
        records, invalid = read_values(((_key_text(meta.get("key", b"")), value) for value, meta in listed),
                                       self.read, self.target.key)
        self.on_records(records, invalid)

    def _watch(self, etcd) -> None:
        try:
            events, cancel = etcd.watch_prefix(self.target.key_prefix)
        except Exception:  # the next list finds out what is wrong
            return
        self._cancel_watch = cancel

        def pump() -> None:
            for _ in events:
                self.changed.set()

        threading.Thread(target=pump, name="discovery-watch-events", daemon=True).start()

    def _end_watch(self) -> None:
        cancel, self._cancel_watch = self._cancel_watch, None
        if cancel is not None:
            try:
                cancel()
            except Exception:
                pass


class EtcdBackend(Backend):
    """``etcd://`` and ``etcds://`` (``backends.BACKENDS``): :class:`Registration` and :class:`Watcher`."""

    @classmethod
    def check(cls, url: str, access) -> list[str]:
        said = plaintext_password(parse_target(url), Credentials.of(access))
        return [said] if said else []

    @classmethod
    def registrar(cls, url: str, access, record, value: bytes, ttl_s: float) -> Registration:
        return Registration(parse_target(url), record, ttl_s, Credentials.of(access), value=value)

    @classmethod
    def watcher(cls, url: str, access, read, on_records, on_outage) -> "Watcher":
        return Watcher(parse_target(url), on_records, on_outage, Credentials.of(access), read=read)
