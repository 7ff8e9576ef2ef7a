"""API keys on the HTTP API of a worker and of the router (``docs/security.md``).

A key comes from ``--api-key KEY``, ``--api-key-file PATH`` (its first line) or the environment
(:data:`API_KEY_ENV`; the router's key for its workers from ``--worker-api-key``,
``--worker-api-key-file`` or :data:`WORKER_API_KEY_ENV`): :func:`load_key` takes them in that
order and refuses two at once, an empty key, or one that cannot travel in an HTTP header.

:func:`api_key_middleware` then guards every route but ``/health`` (and ``/metrics`` unless
``protect_metrics``): deny by default, so a route added later is guarded too. A request without
``Authorization: Bearer <key>``, or with another key, gets 401 with an OpenAI error body
(``invalid_api_key``) and ``WWW-Authenticate: Bearer``, and is counted; the key is compared in
constant time (:func:`hmac.compare_digest`). A key is never logged.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import stat
from typing import Callable, Mapping, Optional

from aiohttp import web

from splitserve.server.openai_protocol import error_body

log = logging.getLogger(__name__)

API_KEY_ENV = "SPLITSERVE_API_KEY"
WORKER_API_KEY_ENV = "SPLITSERVE_WORKER_API_KEY"
OPEN_PATHS = ("/health",)
METRICS_PATH = "/metrics"
MAX_KEY_CHARS = 4096


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
    """``config`` (a ``ServerConfig`` or ``RouterConfig``) with its keys loaded from wherever they
    were given (``api_key`` set, ``api_key_file`` None; the router's ``worker_api_key`` too)."""
    changes = {"api_key": load_key(config.api_key, config.api_key_file, API_KEY_ENV, "--api-key", environ),
               "api_key_file": None}
    if hasattr(config, "worker_api_key"):
        changes["worker_api_key"] = load_key(config.worker_api_key, config.worker_api_key_file, WORKER_API_KEY_ENV,
                                             "--worker-api-key", environ)
        changes["worker_api_key_file"] = None
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


def key_matches(header: Optional[str], key: bytes) -> bool:
    """Whether an ``Authorization`` header value carries ``key`` as a Bearer token (constant time
    in the token)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key)


def unauthorized_counter(registry):
    """``splitserve_http_unauthorized_total{why}`` on ``registry`` (both reasons there from the start)."""
    counter = registry.counter("splitserve_http_unauthorized_total",
                               "Requests refused 401 for a missing or wrong API key.", ["why"])
    for why in ("missing", "wrong"):
        counter.labels(why=why)
    return counter


def access_middlewares(config, registry) -> list:
    """The middleware that asks ``config.api_key`` of every request (none without a key), its
    refusals counted in ``splitserve_http_unauthorized_total`` on ``registry`` — a series there
    from the start, key or not. Every route but /health (and /metrics, unless ``protect_metrics``)
    needs the key: docs/security.md. The router's app and the worker's build theirs here."""
    refused = unauthorized_counter(registry)
    if not config.api_key:
        return []
    return [api_key_middleware(config.api_key, config.protect_metrics, lambda why: refused.labels(why=why).inc())]


def api_key_middleware(key: str, protect_metrics: bool, on_refused: Callable[[str], None]):
    """An aiohttp middleware: 401 for every route but the open ones unless the request carries
    ``key``; ``on_refused(why)`` counts each refusal (``missing`` or ``wrong``)."""
    expected = key.encode("utf-8")
    open_paths = set(OPEN_PATHS) | (set() if protect_metrics else {METRICS_PATH})

    @web.middleware
    async def require_api_key(request: web.Request, handler):
        if request.path in open_paths:
            return await handler(request)
        header = request.headers.get("Authorization")
        if key_matches(header, expected):
            return await handler(request)
        why = "missing" if not header or not header.strip().partition(" ")[2].strip() else "wrong"
        on_refused(why)
        message = ("this server requires an API key: send the header 'Authorization: Bearer <key>'" if why == "missing"
                   else "the API key sent in the Authorization header is not valid for this server")
        return web.json_response(error_body(message, 401, code="invalid_api_key"), status=401,
                                 headers={"WWW-Authenticate": 'Bearer realm="splitserve"'})

    return require_api_key
