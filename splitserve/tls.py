"""TLS on the HTTP API (``docs/security.md``): the server side of the router and of workers
(``--ssl-certfile``, ``--ssl-keyfile``, and ``--ssl-ca-certs`` to require client certificates
signed by that CA), and the router's side towards TLS workers (``--worker-ca-certs`` to trust,
``--worker-ssl-certfile``/``--worker-ssl-keyfile`` as its client certificate). Each builder
checks its files at start and raises ValueError naming the option, so a bad file fails the
process at once (exit 2) rather than every connection later."""

from __future__ import annotations

import ssl
from typing import Optional


def server_context(certfile: Optional[str], keyfile: Optional[str], ca_certs: Optional[str],
                   prefix: str = "--ssl") -> Optional[ssl.SSLContext]:
    """The listening socket's context, or None for plain HTTP (no certificate given)."""
    if certfile is None and keyfile is None:
        if ca_certs is not None:
            raise ValueError(f"{prefix}-ca-certs needs {prefix}-certfile and {prefix}-keyfile (TLS itself)")
        return None
    if certfile is None or keyfile is None:
        raise ValueError(f"{prefix}-certfile and {prefix}-keyfile go together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, certfile, keyfile, prefix)
    if ca_certs is not None:
        _load_ca(ctx, ca_certs, f"{prefix}-ca-certs")
        ctx.verify_mode = ssl.CERT_REQUIRED  # a client without a certificate of that CA is refused
    return ctx


def client_context(ca_certs: Optional[str], certfile: Optional[str], keyfile: Optional[str],
                   prefix: str = "--worker") -> Optional[ssl.SSLContext]:
    """The router's context for ``https://`` workers, or None for the system's trust and no client
    certificate. Worker certificates are always verified, host name included. ``ca_certs``
    replaces the system's CAs: only those of that file are trusted (any public CA's certificate
    for a worker's host name is not)."""
    if ca_certs is None and certfile is None and keyfile is None:
        return None
    if (certfile is None) != (keyfile is None):
        raise ValueError(f"{prefix}-ssl-certfile and {prefix}-ssl-keyfile go together")
    if ca_certs is None:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    else:  # as create_default_context, without loading the system's CAs
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
        _load_ca(ctx, ca_certs, f"{prefix}-ca-certs")
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if certfile is not None:
        _load_chain(ctx, certfile, keyfile, f"{prefix}-ssl")
    return ctx


def _load_chain(ctx: ssl.SSLContext, certfile: str, keyfile: str, prefix: str) -> None:
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{prefix}-certfile {certfile} / {prefix}-keyfile {keyfile}: not a certificate "
                         f"and its key: {exc}") from None


def _load_ca(ctx: ssl.SSLContext, path: str, option: str) -> None:
    try:
        ctx.load_verify_locations(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{option} {path}: not a file of CA certificates: {exc}") from None
