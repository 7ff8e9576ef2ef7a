"""A worker's identity and its discovery record, and their validation.

Every worker has an **id** (``--worker-id``: stable across its restarts; default
``ROLE@ADVERTISE_HOST:PORT``) and an **incarnation** (drawn at each process start, the same one its
control plane uses). It reports both on ``/health`` and ``/get_server_info``; the router tracks
workers by them, so a process that answers on a worker's old port is never taken for it, and a
restarted worker is a new incarnation whose old one has ended.

A :class:`WorkerRecord` is what a worker registers in discovery (``etcd.py``) and what
``POST /workers`` takes. It names the addresses a decode worker will dial (the prefill's URL host
and bootstrap port), so whoever can write it steers KV traffic: :func:`parse_record` accepts only
a JSON object of bounded size with exactly the known fields, each of its type and shape, and the
URL a plain ``http(s)://HOST:PORT`` (no user info, path, query or fragment); constructing one
checks the same rules (:func:`check_fields`). ValueError names the first field that is wrong.

What the KV pages hold (``--kv-cache-dtype``) is part of the model fingerprint (a ``/kv-int8``
suffix: :func:`kv_cache_dtype_of`), so a router never pairs workers whose pages differ, and the
record names it too (``kv_cache_dtype``, left out of the JSON when ``auto``, so that a record of
the model's own dtype reads as before); a record whose field and fingerprint disagree is refused.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from typing import Optional
from urllib.parse import urlsplit

from splitserve.transfer_backends import SERVED

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
MAX_RECORD_BYTES = 4096
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@\[\]-]{0,127}")
INCARNATION_PATTERN = re.compile(r"[A-Za-z0-9]{1,64}")
MODEL_PATTERN = re.compile(r"[\x21-\x7e]{1,256}")
HOST_PATTERN = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
MAX_JSON_DEPTH = 16  # a record is 2 deep, a worker's answers a few: json's decoder recurses once a level
KV_CACHE_DTYPES = ("auto", "int8")
"""--kv-cache-dtype: auto, pages in the model's compute dtype; int8, 8-bit rows with their scales."""
KV_SUFFIX = "/kv-"  # a fingerprint's suffix naming a KV cache dtype other than auto
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')  # a string (closed or not: linear) or a bracket


def loads_shallow(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> object:
    """``json.loads`` for bytes from the network: ValueError for text that is not JSON or that nests
    deeper than ``max_depth`` (which ``json.loads`` would meet with a RecursionError, no ValueError:
    a few kilobytes of brackets are enough). The depth is read before anything is parsed."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode(json.detect_encoding(data))
        except (UnicodeDecodeError, LookupError) as exc:
            raise ValueError(f"not JSON text: {exc}") from None
    depth = 0
    for token in _JSON_TOKEN.finditer(data):
        if token.group()[0] != '"':
            depth += 1 if token.group() in "[{" else -1
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except RecursionError:  # unreachable after the count above; never let it out
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None


def with_kv_cache_dtype(fingerprint: str, kv_cache_dtype: str) -> str:
    """The fingerprint of a model served with pages of ``kv_cache_dtype``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: one of {', '.join(KV_CACHE_DTYPES)}, not {_show(kv_cache_dtype)}")
    return fingerprint if kv_cache_dtype == "auto" else f"{fingerprint}{KV_SUFFIX}{kv_cache_dtype}"


def kv_cache_dtype_of(fingerprint: str) -> str:
    """The KV cache dtype a model fingerprint names (``auto`` when it names none)."""
    head, sep, tail = fingerprint.rpartition(KV_SUFFIX)
    return tail if sep and tail in KV_CACHE_DTYPES else "auto"


def default_worker_id(role: str, host: str, port: int) -> str:
    """The id of a worker started without ``--worker-id``: its role and advertised address."""
    return f"{role}@{host}:{port}"


def check_id(value: object, what: str = "id") -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ValueError(f"{what}: a worker id is 1-128 characters of letters, digits and ._:@-[] "
                         f"starting with a letter or digit, not {_show(value)}")
    return value


def check_incarnation(value: object, what: str = "incarnation") -> str:
    if not isinstance(value, str) or not INCARNATION_PATTERN.fullmatch(value):
        raise ValueError(f"{what}: an incarnation is 1-64 letters and digits, not {_show(value)}")
    return value


def check_url(value: object, what: str = "url") -> str:
    """``http(s)://HOST:PORT`` (a trailing slash dropped), HOST a DNS name or an IP address, in the
    one form every check and comparison takes (:func:`one_form`: ``http://[0::1]:0080`` is
    ``http://[::1]:80``); ValueError for anything else, an alias the resolver would read as an IPv4
    address in another spelling (``127.1``, ``0x7f.0.0.1``) and an IPv6 zone id included."""
    if not isinstance(value, str) or len(value) > 300:
        raise ValueError(f"{what}: a URL is a string of at most 300 characters, not {_show(value)}")
    if not printable_ascii(value):  # urlsplit drops tab, CR and LF before anything could see them
        raise ValueError(f"{what}: a URL is printable ASCII without spaces or control characters, not {_show(value)}")
    url = value.rstrip("/")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{what}: {_show(value)} is not http(s)://HOST:PORT") from None
    host = one_form(parts.hostname or "", bracketed="[" in parts.netloc)
    if (parts.scheme not in ("http", "https") or port is None or not 0 < port < 65536 or parts.username is not None
            or parts.password is not None or parts.path or "?" in url or "#" in url or host is None):
        raise ValueError(f"{what}: {_show(value)} is not http(s)://HOST:PORT (no user, path, query or fragment)")
    return f"{parts.scheme}://{host}:{port}"


def one_form(host: str, bracketed: bool) -> Optional[str]:
    """A URL's host in its one form (an IPv6 address bracketed and compressed, an IPv4 address
    dotted, a name in lower case), or None when it is none of them or an alias of one."""
    if "%" in host:  # an IPv6 zone id: local to one host's interfaces
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if bracketed:
        return f"[{ip.compressed}]" if isinstance(ip, ipaddress.IPv6Address) else None
    if ip is not None:
        return str(ip)
    last = host.rsplit(".", 1)[-1].lower()
    if not HOST_PATTERN.fullmatch(host) or last.isdigit() or last.startswith("0x"):
        return None  # a numeric last label is read as an IPv4 address by resolvers: 127.1, 0x7f.1
    return host.lower()


def printable_ascii(text: str) -> bool:
    """Whether ``text`` is only printable ASCII, no space (what a URL here may hold)."""
    return all(33 <= ord(c) < 127 for c in text)


def check_port(value: object, what: str = "bootstrap_port") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise ValueError(f"{what}: a port is an integer in 1-65535, not {_show(value)}")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclasses.dataclass(frozen=True)
class WorkerRecord:
    """One worker as discovery names it."""

    id: str
    incarnation: str
    role: str  # prefill | decode
    url: str  # its HTTP API, as the router reaches it
    bootstrap_port: Optional[int]  # prefill: its control endpoint (on the URL's host); decode: None
    model: str  # the model fingerprint (bootstrap.model_identity: quantization included)
    protocol_version: int
    transfer_backend: str  # nixl | tcp
    kv_cache_dtype: Optional[str] = None  # what its pages hold (KV_CACHE_DTYPES); None: the model's says

    def __post_init__(self):
        """The rules :func:`parse_record` reads a record with (the one set): a worker never
        registers a record that routers refuse. The URL is kept in its one form."""
        if self.kv_cache_dtype is None:  # a model that is no string is refused below, as parsed
            kv = kv_cache_dtype_of(self.model) if isinstance(self.model, str) else "auto"
            object.__setattr__(self, "kv_cache_dtype", kv)
        object.__setattr__(self, "url", check_fields(self.id, self.incarnation, self.role, self.url,
                                                     self.bootstrap_port, self.model, self.protocol_version,
                                                     self.transfer_backend, self.kv_cache_dtype))

    def to_json(self) -> bytes:
        fields = dataclasses.asdict(self)
        if fields["kv_cache_dtype"] == "auto":  # as a record read before the field existed
            del fields["kv_cache_dtype"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @property
    def identity(self) -> tuple[str, str]:
        return self.id, self.incarnation


FIELDS = tuple(f.name for f in dataclasses.fields(WorkerRecord))


def parse_record(data: bytes | str | dict) -> WorkerRecord:
    """A :class:`WorkerRecord` from its JSON (or an already parsed object); ValueError naming what
    is wrong. Nothing about it is trusted: size, fields, types and shapes are all checked."""
    if isinstance(data, (bytes, str)):
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"a worker record is at most {MAX_RECORD_BYTES} bytes, not {len(data)}")
        try:
            data = loads_shallow(data)
        except ValueError as exc:
            raise ValueError(f"a worker record is a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("a worker record is a JSON object")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown fields in a worker record: {', '.join(map(_show, unknown[:5]))}")
    fields = {name: data.get(name) for name in FIELDS}
    fields["kv_cache_dtype"] = data.get("kv_cache_dtype", "auto")  # absent: as before the field existed
    if fields["kv_cache_dtype"] is None:  # None makes WorkerRecord derive it; null in JSON is no dtype
        raise ValueError(f"kv_cache_dtype: one of {', '.join(KV_CACHE_DTYPES)}, not None")
    return WorkerRecord(**fields)  # its fields checked there (__post_init__: check_fields)


def check_fields(id: object, incarnation: object, role: object, url: object, bootstrap_port: object,
                 model: object, protocol_version: object, transfer_backend: object, kv_cache_dtype: object) -> str:
    """ValueError naming the first field of a record that is wrong (in one order, whichever way
    the record is made); else its URL in its one form."""
    if role not in ROLES:
        raise ValueError(f"role: prefill or decode, not {_show(role)}")
    if role == PREFILL:
        check_port(bootstrap_port)
    elif bootstrap_port is not None:
        raise ValueError("bootstrap_port: a decode worker has none")
    check_model(model)
    if not isinstance(protocol_version, int) or isinstance(protocol_version, bool) \
            or not 0 <= protocol_version < 1 << 31:
        raise ValueError(f"protocol_version: a non-negative integer, not {_show(protocol_version)}")
    if transfer_backend not in SERVED:
        raise ValueError(f"transfer_backend: one of {', '.join(SERVED)}, not {_show(transfer_backend)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: one of {', '.join(KV_CACHE_DTYPES)}, not {_show(kv_cache_dtype)}")
    if kv_cache_dtype != kv_cache_dtype_of(model):
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype}, but the model fingerprint names "
                         f"{kv_cache_dtype_of(model)}")
    check_id(id)
    check_incarnation(incarnation)
    return check_url(url)


def check_model(value: object) -> str:
    if not isinstance(value, str) or not MODEL_PATTERN.fullmatch(value):
        raise ValueError(f"model: a fingerprint is 1-256 printable characters, not {_show(value)}")
    return value


def identity_of(body: object) -> Optional[tuple[str, str]]:
    """``(id, incarnation)`` from a worker's ``/health`` answer, or None when it carries none
    that is well formed (then it is no splitserve worker this router can trust)."""
    if not isinstance(body, dict):
        return None
    try:
        return check_id(body.get("id")), check_incarnation(body.get("incarnation"))
    except ValueError:
        return None
