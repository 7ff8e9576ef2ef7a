"""A worker's proof that it holds a key of the cluster, which a router asks before it trusts the
worker with its worker key or a client's prompt.

The router sends a fresh random nonce (:func:`new_nonce`) in the header :data:`NONCE_HEADER` of a
health check; the worker answers on ``/health`` with ``"proof": {NAME: HEX}``, one HMAC-SHA256 per
key it holds (:func:`prove`) of :data:`DOMAIN`, the nonce, and the id and incarnation it answers
with. The keys, by name: ``secret``, derived from the cluster secret (its own HKDF label,
``disagg/control/curve.py``), and ``key``, the worker key (``--worker-api-key``). The router
accepts the answer when one proof verifies under a key it holds too (:func:`verify`), so an answer
cannot be replayed for another nonce nor moved to another identity.

What it does not show: that the process proving is the one at the address the router dialled (a
process the router was pointed at could relay the nonce to a real worker). The address is as
trustworthy as what named it: a signed record (``signing.py``), the command line, ``POST /workers``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Mapping, Optional

NONCE_HEADER = "X-Splitserve-Nonce"
NONCE = re.compile(r"[0-9a-f]{32}")
DOMAIN = b"splitserve identity proof v1\n"
SECRET, KEY = "secret", "key"
"""The names of the keys a proof may be made with: the cluster secret's proof key, the worker key."""


def new_nonce() -> str:
    return secrets.token_hex(16)


def _mac(key: bytes, nonce: str, worker_id: str, incarnation: str) -> str:
    message = DOMAIN + f"{nonce}\n{worker_id}\n{incarnation}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def prove(keys: Mapping[str, bytes], nonce: Optional[str], worker_id: str, incarnation: str) -> dict:
    """The proofs of a worker holding ``keys`` for ``nonce`` (a header's value: anything but a
    well-formed nonce gets none), by key name."""
    if not keys or not isinstance(nonce, str) or not NONCE.fullmatch(nonce):
        return {}
    return {name: _mac(key, nonce, worker_id, incarnation) for name, key in sorted(keys.items())}


def verify(keys: Mapping[str, bytes], proof: object, nonce: str, worker_id: str, incarnation: str) -> bool:
    """Whether ``proof`` (from a worker's ``/health`` answer) holds, for one key of ``keys``, the
    HMAC of ``nonce`` and the identity the worker answered with. Constant time in each proof."""
    if not isinstance(proof, dict):
        return False
    ok = False
    for name, key in keys.items():
        given = proof.get(name)
        if isinstance(given, str) and len(given) == 64:
            ok |= hmac.compare_digest(given.encode("ascii", "replace"),
                                      _mac(key, nonce, worker_id, incarnation).encode())
    return ok
