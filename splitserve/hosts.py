"""Host strings, each in the one form its use takes: a URL, a ZMQ endpoint, a comparison.

An IPv6 address is written in brackets wherever a port may follow it (``[::1]:8998``): in a URL
(RFC 3986), in a ZMQ ``tcp://`` endpoint (libzmq reads ``tcp://::1:8998`` as a name and refuses
it), and in a ``bootstrap_host`` (a worker refuses an IPv6 address without brackets). Whatever
forms, checks or compares a host goes through here, so that the router, the workers and the
allow-lists never disagree on how one address is written: :func:`url_host` (a URL's or a
``bootstrap_host``'s form), :func:`host_port`, :func:`zmq_endpoint`, :func:`allow_host` (the key
two hosts are compared by; an IPv4-mapped address as the IPv4 address it maps) and
:func:`check_host` (a host from the network, or ValueError).

A ZMQ socket that binds or connects over TCP also needs ``zmq.IPV6`` set, or libzmq resolves IPv4
only: each socket's owner sets it (``disagg/control``, ``disagg/transfer/tcp.py``).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Optional, Union

NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]{0,252})")
"""A host name (or an IPv4 address, which the same letters spell): at most 253 characters."""
ANY = ("", "*")


def _ipv6(host: str) -> Optional[ipaddress.IPv6Address]:
    """The IPv6 address ``host`` spells, with or without brackets (no zone), else None."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" not in bare or "%" in bare:
        return None
    try:
        return ipaddress.IPv6Address(bare)
    except ValueError:
        return None


def url_host(host: str) -> str:
    """``host`` as a URL's authority or a ``bootstrap_host`` writes it: an IPv6 address (given with
    or without brackets) in brackets, compressed, lower case; any other host as given."""
    ip = _ipv6(host)
    return f"[{ip.compressed}]" if ip is not None else host


def host_port(host: str, port: Union[int, str]) -> str:
    """``HOST:PORT``, the host as :func:`url_host` writes it."""
    return f"{url_host(host)}:{port}"


def zmq_endpoint(host: str, port: Union[int, str, None]) -> str:
    """``tcp://HOST:PORT`` for a ZMQ bind or connect; an empty or ``*`` host, and a port of 0 or
    None, are ``*`` (any address; a free port)."""
    return "tcp://" + host_port("*" if host in ANY else host, port if port else "*")


def allow_host(host: str) -> str:
    """The form in which hosts are compared (allow-lists, a worker naming itself): lower case, an
    IPv6 address as :func:`url_host` writes it, an IPv4-mapped IPv6 address as its IPv4 address,
    a name's trailing dot dropped."""
    ip = _ipv6(host)
    if ip is not None:
        return str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else f"[{ip.compressed}]"
    return host.lower().removesuffix(".")


def check_bind_host(host: str, flag: str = "--host") -> str:
    """``host`` as a listening address is given (``--host``): a name, an IPv4 address or an IPv6
    address without brackets (``::1``; the socket takes no brackets) and without a zone id;
    ValueError saying which form to give."""
    if "%" in host:
        raise ValueError(f"{flag} {host!r}: a zone id (%...) is not supported; give a global, unique local or "
                         "loopback address")
    if host.startswith("[") and host.endswith("]") and _ipv6(host) is not None:
        raise ValueError(f"{flag} {host!r}: an address to listen on is written without brackets: {host[1:-1]}")
    if host in ANY or host == "::" or _ipv6(host) is not None or NAME.fullmatch(host):
        return host
    raise ValueError(f"{flag} {host!r} is not a host name, an IPv4 address or an IPv6 address (no brackets)")


def check_host(host: object) -> str:
    """``host`` from the network (a ``bootstrap_host``) in :func:`url_host`'s form; ValueError
    unless it is a host name, an IPv4 address or an IPv6 address in brackets."""
    if not isinstance(host, str):
        raise ValueError("a host is a string")
    if host.startswith("["):
        if _ipv6(host) is None:
            raise ValueError(f"{host[:64]!r} is not an IPv6 address in brackets")
        return url_host(host)
    if _ipv6(host) is not None:
        raise ValueError(f"an IPv6 address is written in brackets: [{host}]")
    if not NAME.fullmatch(host):
        raise ValueError(f"{host[:64]!r} is not a host name or an IP address")
    return host
