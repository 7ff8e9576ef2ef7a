"""A worker's keys for proving who it is to a router, and its answer to a router's nonce
(``discovery/proof.py``; what a record is sealed with: ``discovery/signing.py``).

A worker holds the keys it was given: the cluster secret's proof and record keys
(``--cluster-secret-file``) and its worker key (``--worker-api-key``). ``/health`` answers a
router's nonce with a proof under each (:func:`answer`); a worker with neither can prove nothing,
and a router that holds a key never trusts it (``docs/security.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from splitserve.discovery.proof import KEY, NONCE_HEADER, SECRET, prove


@dataclasses.dataclass(frozen=True)
class WorkerKeys:
    proof: Mapping[str, bytes] = dataclasses.field(default_factory=dict, repr=False)  # by proof.SECRET / KEY
    record: Optional[bytes] = dataclasses.field(default=None, repr=False)  # seals its discovery record

    @classmethod
    def of(cls, config) -> "WorkerKeys":
        """The keys of a ``ServerConfig`` (its keys loaded); ValueError for a bad secret file."""
        proof, record = {}, None
        if getattr(config, "cluster_secret_file", None):
            from splitserve.disagg.control.curve import ClusterSecret

            secret = ClusterSecret.load(config.cluster_secret_file, warn=False)
            proof[SECRET], record = secret.proof_key, secret.record_key
        if getattr(config, "worker_api_key", None):
            proof[KEY] = config.worker_api_key.encode("utf-8")
        return cls(proof, record)


def answer(headers: Mapping[str, str], keys: WorkerKeys, identity: dict) -> dict:
    """What ``/health`` adds for a request carrying a router's nonce: ``{"proof": {NAME: HEX}}``
    (nothing without a well-formed nonce or without keys)."""
    proofs = prove(keys.proof, headers.get(NONCE_HEADER), identity["id"], identity["incarnation"])
    return {"proof": proofs} if proofs else {}
