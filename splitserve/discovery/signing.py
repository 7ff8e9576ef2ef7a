"""Signed discovery records: whoever can write under the discovery prefix steers a router's
traffic, so a router given the cluster secret uses only records a cluster member wrote.

A worker with the cluster secret seals its record (:meth:`RecordSeal.seal`) under the **record
key**, a key of its own derived from the secret (``disagg/control/curve.py``, its own HKDF label):
the value put in etcd is ``{"record": RECORD, "hmac": HEX}``, HEX the HMAC-SHA256 under that key of
:data:`DOMAIN` and the record's canonical JSON (``WorkerRecord.to_json``: sorted keys, no spaces).
A router with the secret opens every value (:meth:`RecordSeal.open`) before it uses it: a bare
record, a value without a well-formed tag, or a tag that does not verify raises :class:`Unverified`
(a ``ValueError``), so the value is dropped and counted like any other invalid value.

Without a key (a cluster with no secret) a worker writes its bare record, and a router takes a
bare or a sealed record unverified: it trusts whoever can write under the prefix
(``docs/security.md``, what a deployment without keys gets). A seal proves who wrote a record,
not that it is current: an old record of a member put again is still a member's record (its
incarnation is pinned, and the worker must answer the router's nonce before it gets anything:
``discovery/proof.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
from typing import Optional

from splitserve.discovery.record import MAX_RECORD_BYTES, WorkerRecord, loads_shallow, parse_record

DOMAIN = b"splitserve worker record v1\n"
MAX_SEALED_BYTES = MAX_RECORD_BYTES + 256  # a record and its tag
TAG = re.compile(r"[0-9a-f]{64}")


class Unverified(ValueError):
    """A value that is no record a holder of the cluster secret wrote: unsigned or badly signed."""


def tag(key: bytes, record: WorkerRecord) -> str:
    return hmac.new(key, DOMAIN + record.to_json(), hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class RecordSeal:
    """Seals (a worker) and opens (a router) discovery records under ``key`` (None: no secret)."""

    key: Optional[bytes] = dataclasses.field(default=None, repr=False)

    def seal(self, record: WorkerRecord) -> bytes:
        """The value to put in etcd for ``record``: sealed with the key, else the bare record."""
        if self.key is None:
            return record.to_json()
        body = json.loads(record.to_json())
        return json.dumps({"record": body, "hmac": tag(self.key, record)}, sort_keys=True,
                          separators=(",", ":")).encode()

    def open(self, value: bytes | str) -> WorkerRecord:
        """The record in ``value``; ValueError when it is none, :class:`Unverified` when this seal
        has a key and the value is not sealed with it."""
        if len(value) > MAX_SEALED_BYTES:
            raise ValueError(f"a worker record is at most {MAX_SEALED_BYTES} bytes sealed, not {len(value)}")
        try:
            data = loads_shallow(value)
        except ValueError as exc:
            raise ValueError(f"a worker record is a JSON object: {exc}") from None
        sealed = isinstance(data, dict) and set(data) == {"record", "hmac"}
        if self.key is None:
            return parse_record(data["record"] if sealed else data)
        if not sealed:
            parse_record(data)  # a malformed value says what is wrong with it first
            raise Unverified("unsigned: a record not sealed with the cluster secret (is the worker given "
                             "--cluster-secret-file?)")
        record = parse_record(data["record"])
        given = data["hmac"]
        if not isinstance(given, str) or not TAG.fullmatch(given) or \
                not hmac.compare_digest(given, tag(self.key, record)):
            raise Unverified("badly signed: its seal does not verify under this router's cluster secret")
        return record
