"""API keys on the HTTP API of a worker and of the router: which key opens which route
(``docs/security.md`` has the table and the reasons).

Four keys, each from ``--NAME KEY``, ``--NAME-file PATH`` (its first line) or the environment
(:data:`KEYS`; :func:`load_key` takes them in that order and refuses two at once, an empty key, or
one that cannot travel in an HTTP header): the **client** key (``--api-key``), the **worker** key
(``--worker-api-key``: every route of a worker, and the only one that may send a split request's
bootstrap fields, :func:`bootstrap_refusal`), the **admin** key and the **metrics** key.

Each route belongs to one class (:data:`ROUTER_ROUTES`, :data:`WORKER_ROUTES`): ``open``,
``client``, ``metrics`` or ``admin``; a route in neither table is ``admin`` (deny by default). A
process given no key is open. Given any key, a route needs a key that opens its class
(:meth:`Access.opens`, :meth:`Access.openers`). No key or an unknown one is a 401
(``invalid_api_key``, ``WWW-Authenticate: Bearer``); a known key that does not open the route a
403 (``permission_denied``); both are counted. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import os
import stat
from typing import Callable, Mapping, Optional

from aiohttp import web

from splitserve.errors import error_body
from splitserve.hosts import allow_host, check_host, url_host

log = logging.getLogger(__name__)

API_KEY_ENV = "SPLITSERVE_API_KEY"
WORKER_API_KEY_ENV = "SPLITSERVE_WORKER_API_KEY"
ADMIN_API_KEY_ENV = "SPLITSERVE_ADMIN_API_KEY"
METRICS_API_KEY_ENV = "SPLITSERVE_METRICS_API_KEY"
MAX_KEY_CHARS = 4096

CLIENT, WORKER, ADMIN, METRICS = "client", "worker", "admin", "metrics"
"""The keys, by name; also the names of the route classes (but ``worker``, which is no route class)."""
OPEN = "open"
METRICS_PATH = "/metrics"
KEYS = {CLIENT: ("api_key", "--api-key", API_KEY_ENV),
        WORKER: ("worker_api_key", "--worker-api-key", WORKER_API_KEY_ENV),
        ADMIN: ("admin_api_key", "--admin-api-key", ADMIN_API_KEY_ENV),
        METRICS: ("metrics_api_key", "--metrics-api-key", METRICS_API_KEY_ENV)}
"""Each key's config field, flag (its file: the flag with ``-file``) and environment variable."""

GENERATION = ("/v1/completions", "/v1/chat/completions", "/generate")
ROUTER_ROUTES = {**dict.fromkeys(GENERATION, CLIENT), "/v1/models": CLIENT, "/health": OPEN, "/metrics": METRICS,
                 "/workers": ADMIN, "/workers/{id}": ADMIN, "/debug/requests/{rid}": ADMIN, "/flush_cache": ADMIN,
                 "/tokenize": CLIENT, "/detokenize": CLIENT}
WORKER_ROUTES = {**dict.fromkeys(GENERATION, CLIENT), "/v1/models": CLIENT, "/get_model_info": CLIENT,
                 "/health": OPEN, "/metrics": METRICS, "/get_server_info": METRICS, "/debug/requests": ADMIN,
                 "/debug/requests/{rid}": ADMIN, "/debug/rooms/{room}": ADMIN, "/flush_cache": ADMIN,
                 "/abort_request": ADMIN, "/role": ADMIN, "/tokenize": CLIENT, "/detokenize": CLIENT}
"""The class of every route, by its path as aiohttp names it (``resource.canonical``)."""

ACCESS = web.RequestKey("splitserve_access", object)
"""On every request: ``(Access, the name of the key it presented or None)``."""


def load_key(value: Optional[str], path: Optional[str], env_name: str, flag: str = "--api-key",
             environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The key from ``flag`` (``value``), ``flag``-file (``path``) or the environment variable
    ``env_name``, in that order, or None when none is set. ValueError (naming where the key came
    from, never the key) for a flag and its file together, an unreadable or empty file, or a key
    that is not printable ASCII without spaces (it travels in the ``Authorization`` header)."""
    environ = os.environ if environ is None else environ
    if value is not None and path is not None:
        raise ValueError(f"{flag} and {flag}-file are two keys: give one")
    if value is not None:
        return check_key(value, flag)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_KEY_CHARS + 2)
            mode = os.stat(path).st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag}-file {path}: cannot read it: {exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s-file %s can be read by other users (mode %o): chmod 600 it", flag, path,
                        stat.S_IMODE(mode))
        lines = text.splitlines()
        return check_key(lines[0] if lines else "", f"{flag}-file {path}")
    if environ.get(env_name):
        return check_key(environ[env_name], f"${env_name}")
    return None


def with_keys(config, environ: Optional[Mapping[str, str]] = None):
    """``config`` (a ``ServerConfig`` or ``RouterConfig``) with every key it has a field for loaded
    from wherever it was given (the key set, its file None). ValueError for a bad key, or for one
    key given in two roles (each role's key must be its own, or a client key would open more)."""
    changes: dict[str, Optional[str]] = {}
    where: dict[str, str] = {}
    for field, flag, env in KEYS.values():
        if hasattr(config, field):
            key = load_key(getattr(config, field), getattr(config, field + "_file"), env, flag, environ)
            changes[field], changes[field + "_file"] = key, None
            if key is not None:
                if key in where:
                    raise ValueError(f"{where[key]} and {flag} are the same key: give each its own")
                where[key] = flag
    return dataclasses.replace(config, **changes)


def check_key(key: str, where: str) -> str:
    key = key.strip()
    if not key:
        raise ValueError(f"{where}: the API key is empty")
    if len(key) > MAX_KEY_CHARS or not all(33 <= ord(c) < 127 for c in key):
        raise ValueError(f"{where}: an API key is printable ASCII without spaces, at most {MAX_KEY_CHARS} "
                         "characters (it is sent in the Authorization header)")
    return key


def bearer(key: str) -> dict[str, str]:
    """The header a client sends with ``key``."""
    return {"Authorization": f"Bearer {key}"}


def bearer_token(header: Optional[str]) -> Optional[bytes]:
    """The token of an ``Authorization: Bearer <token>`` header value, or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("utf-8", "surrogateescape")


def key_matches(header: Optional[str], key: bytes) -> bool:
    """Whether an ``Authorization`` header value carries ``key`` as a Bearer token (constant time
    in the token)."""
    token = bearer_token(header)
    return token is not None and hmac.compare_digest(token, key)


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may call what on one process: its incoming keys (by name), whether it is a worker (the
    worker key opens everything there) and whether ``/metrics`` is guarded."""

    keys: Mapping[str, bytes]
    on_worker: bool
    protect_metrics: bool = True

    @classmethod
    def of(cls, config, on_worker: bool) -> "Access":
        """The access of a ``ServerConfig`` (``on_worker``) or a ``RouterConfig`` (whose worker key
        is the one it sends, not one it takes)."""
        names = (CLIENT, WORKER, ADMIN, METRICS) if on_worker else (CLIENT, ADMIN, METRICS)
        keys = {name: getattr(config, KEYS[name][0]).encode("utf-8") for name in names
                if getattr(config, KEYS[name][0], None)}
        return cls(keys, on_worker, getattr(config, "protect_metrics", True))

    def openers(self, kind: str) -> Optional[frozenset]:
        """The keys that open a route of class ``kind``, or None when it is open to anyone.

        - No key given to this process: every route is open.
        - ``open``: open. ``client``: the client key (and on a worker the worker key); open when
          none of them is set.
        - ``metrics``: the metrics or the admin key (on a worker also the worker key); when none of
          them is set, whatever opens ``client``.
        - ``admin`` (and any class not known): the admin key (on a worker also the worker key);
          when none of them is set, no key at all (the route is closed on a keyed process).
        """
        if not self.keys or kind == OPEN:
            return None
        worker = {WORKER} if self.on_worker else set()
        if kind in (CLIENT, METRICS):
            own = ({CLIENT} if kind == CLIENT else {METRICS, ADMIN}) | worker
            if own & self.keys.keys():
                return frozenset(own & self.keys.keys())
            return self.openers(CLIENT) if kind == METRICS else None
        return frozenset(({ADMIN} | worker) & self.keys.keys())

    def who(self, header: Optional[str]) -> Optional[str]:
        """The name of the key an ``Authorization`` header carries, or None (none, or not ours).
        Every key is compared, in constant time."""
        token = bearer_token(header)
        found = None
        for name, key in self.keys.items():
            if token is not None and hmac.compare_digest(token, key):
                found = name
        return found

    def may(self, kind: str, who: Optional[str]) -> bool:
        openers = self.openers(kind)
        return openers is None or who in openers


def caller_may(request: web.Request, kind: str) -> bool:
    """Whether the caller of ``request`` (as the access middleware saw it) opens class ``kind``;
    true on an app without the middleware."""
    seen = request.get(ACCESS)
    return seen is None or seen[0].may(kind, seen[1])


def caller_is(request: web.Request, name: str) -> bool:
    """Whether ``request`` presented this process's key ``name`` (``worker``: the router's)."""
    seen = request.get(ACCESS)
    return seen is not None and seen[1] == name


@dataclasses.dataclass(frozen=True)
class AllowedPrefill:
    """``--allowed-prefill``: the bootstrap addresses a decode worker may be sent to."""

    addresses: frozenset  # (host, port or None for any port), hosts as hosts.allow_host writes them
    networks: tuple  # ipaddress networks: any address in them, any port

    def __contains__(self, address: tuple) -> bool:
        host, port = allow_host(address[0]), address[1]
        if (host, port) in self.addresses or (host, None) in self.addresses:
            return True
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return any(ip in net for net in self.networks)


def parse_allowed_prefill(text: Optional[str]) -> Optional[AllowedPrefill]:
    """``--allowed-prefill``: comma-separated ``HOST:PORT`` (a prefill's bootstrap address, as the
    router names it: the host of its URL; ``[V6]:PORT`` for IPv6), ``HOST`` (any port there; an
    IPv6 address with or without brackets) or ``NETWORK/BITS`` (any address in it, any port); None
    when unset. Hosts are compared as ``hosts.allow_host`` writes them (``[0:0::1]`` is ``[::1]``,
    names in any case). ValueError naming an entry that is none of them, or that reads both as
    an IPv6 address and as one with a port (``::1:8998``)."""
    if text is None:
        return None
    addresses, networks = set(), []
    for entry in (e.strip() for e in text.split(",")):
        if "/" in entry:
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                raise ValueError(f"--allowed-prefill: {entry!r} is not a network (NETWORK/BITS)") from None
        host, port = entry, None
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            host = f"[{host}]"
            if rest:
                port = rest.removeprefix(":") if rest.startswith(":") else "bad"
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        elif entry.rpartition(":")[2].isdigit() and url_host(entry.rpartition(":")[0]).startswith("["):
            raise ValueError(f"--allowed-prefill: {entry!r} is ambiguous: an IPv6 address with a port is written "
                             "[ADDRESS]:PORT (any port: [ADDRESS])")
        try:
            port = None if port is None else int(port)
        except ValueError:
            port = 0
        try:
            host = check_host(url_host(host))  # a bare IPv6 address is a host, any port
        except ValueError:
            host = ""
        if not host or port is not None and not 0 < port < 65536:
            raise ValueError(f"--allowed-prefill: {entry!r} is not HOST:PORT, HOST or NETWORK/BITS")
        addresses.add((allow_host(host), port))
    return AllowedPrefill(frozenset(addresses), tuple(networks))


def check_bootstrap_trust(config) -> None:
    """At a worker's start: ValueError for a malformed ``--allowed-prefill``, or for a decode worker
    that could take no bootstrap address at all (neither the router's key nor a list)."""
    allowed = parse_allowed_prefill(config.allowed_prefill)
    if config.role == "decode" and allowed is None and not config.worker_api_key:
        raise ValueError("--role decode dials the prefill that a request names: give it the router's key "
                         "(--worker-api-key, then only the router may name one) or --allowed-prefill HOST:PORT,... "
                         "(the prefills' bootstrap addresses)")


def check_control_plane(config) -> None:
    """At a worker's start: ValueError for a prefill or decode worker with neither a cluster secret
    nor ``--insecure-control-plane``. Without the secret, whoever reaches its control sockets speaks
    the protocol, and on the tcp backend can write into decode's KV pool (docs/security.md): that is
    a choice an operator makes by name, never a default."""
    if config.role in ("prefill", "decode") and not config.cluster_secret_file and not config.insecure_control_plane:
        raise ValueError(f"--role {config.role} needs --cluster-secret-file FILE, the secret every prefill and "
                         "decode worker of the cluster shares (make one: head -c 32 /dev/urandom | base64 > FILE; "
                         "chmod 600 FILE), or --insecure-control-plane to run without one on a network no one "
                         "else can reach")


def bootstrap_refusal(request: web.Request, host: Optional[str], port: Optional[int], room: Optional[int],
                      role: str, allowed: Optional[AllowedPrefill]) -> Optional[str]:
    """Why a generation request's bootstrap fields may not be taken from this caller, or None.
    A decode worker dials the address they name and hands it its receiving link: a worker with the
    router's key takes them only from its holder, and a decode worker with ``--allowed-prefill``
    (or without the router's key, which must then have the list) only for an address on it."""
    if host is None and port is None and room is None:
        return None
    seen = request.get(ACCESS)
    access, who = seen if seen is not None else (None, None)
    keyed = access is not None and WORKER in access.keys
    if keyed and who != WORKER:
        return ("bootstrap_host, bootstrap_port and bootstrap_room are taken only from the router: a request "
                "carrying them needs the router's key (--worker-api-key)")
    if role != "decode" or host is None:
        return None
    if allowed is None:
        return None if keyed else ("this decode worker takes a bootstrap address only from the router's key "
                                   "(--worker-api-key) or on its --allowed-prefill list, and was given neither")
    if (host, port) in allowed:
        return None
    return f"the bootstrap address {host}:{port} is not on this decode worker's --allowed-prefill list"


def router_fields_refusal(request: web.Request, stream_ids: bool, continuation: bool) -> Optional[str]:
    """Why ``stream_ids`` or ``continuation`` may not be taken from this caller, or None: a worker
    with the router's key takes them only from its holder (an unkeyed worker from anyone)."""
    if not stream_ids and not continuation:
        return None
    seen = request.get(ACCESS)
    access, who = seen if seen is not None else (None, None)
    if access is not None and WORKER in access.keys and who != WORKER:
        return ("stream_ids and continuation are taken only from the router: a request carrying them needs "
                "the router's key (--worker-api-key)")
    return None


def unauthorized_counter(registry):
    """``splitserve_http_unauthorized_total{why}`` on ``registry`` (every reason there from the start)."""
    counter = registry.counter("splitserve_http_unauthorized_total",
                               "Requests refused for a missing or wrong API key (401), or for a key that does not "
                               "open the route (403).", ["why"])
    for why in ("missing", "wrong", "forbidden"):
        counter.labels(why=why)
    return counter


def access_middlewares(config, registry, routes: Mapping[str, str], on_worker: bool) -> list:
    """The middleware that checks every request of an app against ``routes`` (its route classes)
    and the keys of ``config``, its refusals counted in ``splitserve_http_unauthorized_total`` on
    ``registry``. The router's app and the worker's build theirs here."""
    refused = unauthorized_counter(registry)
    return [access_middleware(Access.of(config, on_worker), routes, lambda why: refused.labels(why=why).inc())]


def access_middleware(access: Access, routes: Mapping[str, str], on_refused: Callable[[str], None]):
    """An aiohttp middleware: a route of ``routes`` (an unknown one is ``admin``) answers only a
    caller whose key opens its class; ``on_refused(why)`` counts each refusal (``missing``,
    ``wrong`` or ``forbidden``)."""
    flags = {name: flag for name, (_, flag, _) in KEYS.items()}

    @web.middleware
    async def require_api_key(request: web.Request, handler):
        sent = request.headers.getall("Authorization", [])
        header = sent[0] if len(sent) == 1 else None  # two credentials are none: neither is taken
        who = access.who(header) if access.keys else None
        request[ACCESS] = (access, who)
        resource = request.match_info.route.resource
        kind = routes.get(resource.canonical, ADMIN) if resource is not None else CLIENT  # unmatched: 404/405
        if request.path == METRICS_PATH and not access.protect_metrics:
            kind = OPEN
        openers = access.openers(kind)
        if openers is None or who in openers:
            return await handler(request)
        if who is not None:
            on_refused("forbidden")
            needs = " or ".join(sorted(flags[name] for name in openers)) if openers else None
            message = (f"this API key does not open {request.method} {request.path}: it needs the key given as "
                       f"{needs}" if needs else
                       f"{request.method} {request.path} is closed on this server: it opens with --admin-api-key, "
                       "and this server was given none")
            return web.json_response(error_body(message, 403, code="permission_denied"), status=403)
        why = "missing" if len(sent) < 2 and not (header or "").strip().partition(" ")[2].strip() else "wrong"
        on_refused(why)
        message = ("this server requires an API key: send the header 'Authorization: Bearer <key>'" if why == "missing"
                   else f"send one Authorization header, not {len(sent)}" if len(sent) > 1
                   else "the API key sent in the Authorization header is not valid for this server")
        return web.json_response(error_body(message, 401, code="invalid_api_key"), status=401,
                                 headers={"WWW-Authenticate": 'Bearer realm="splitserve"'})

    return require_api_key
