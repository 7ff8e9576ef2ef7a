"""Small helpers shared by the worker's and the router's HTTP servers."""

from __future__ import annotations

from aiohttp import web


def bound_url(runner: web.AppRunner, host: str, port: int) -> str:
    """The base URL a client on this host can use: the port actually bound (differs from the
    configured one with ``--port 0``), and loopback for a wildcard host."""
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            port = addr[1]
            break
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"
