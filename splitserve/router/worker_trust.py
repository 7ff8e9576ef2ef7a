"""What the router trusts a worker with, and from when (``docs/security.md``, where the reasoning is).

The router's keys (:class:`RouterKeys`): its worker key (``--worker-api-key``, what opens every
route of a worker) and, from ``--cluster-secret-file``, the cluster secret's record key (discovery
records are used only once their seal verifies: ``discovery/signing.py``) and proof key.

A worker gets nothing of value before it proved itself: every health check carries a fresh nonce
(``discovery/proof.py``), and a worker is *proven* (``Worker.proven``) only while its last answer
held a proof under a key the router holds too. Only a proven worker is routable, and the worker key
travels only on calls to a proven worker's address (:func:`worker_key_middleware`, on the one
session every leg, check and admin call uses), never on the ``/health`` probe. A probe that fails
or times out unproves the worker at once. The proof binds the worker's id and incarnation and the
router's nonce, not the URL the router dialled. A router without keys cannot ask for a proof: it
trusts every worker it is told of, and says so at start (:meth:`RouterKeys.warnings`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from yarl import URL

from splitserve.auth import bearer
from splitserve.discovery.proof import KEY, SECRET
from splitserve.discovery.signing import RecordSeal


@dataclasses.dataclass(frozen=True)
class RouterKeys:
    worker_key: Optional[str] = dataclasses.field(default=None, repr=False)
    proof: Mapping[str, bytes] = dataclasses.field(default_factory=dict, repr=False)  # by proof.SECRET / KEY
    seal: RecordSeal = RecordSeal()

    @classmethod
    def of(cls, config) -> "RouterKeys":
        """The keys of a ``RouterConfig`` (its keys loaded); ValueError for a bad secret file."""
        proof, record = {}, None
        if config.cluster_secret_file:
            from splitserve.disagg.control.curve import ClusterSecret

            secret = ClusterSecret.load(config.cluster_secret_file, warn=True)
            proof[SECRET], record = secret.proof_key, secret.record_key
        if config.worker_api_key:
            proof[KEY] = config.worker_api_key.encode("utf-8")
        return cls(config.worker_api_key, proof, RecordSeal(record))

    def warnings(self, config) -> list[str]:
        """What this router leaves open, said at its start."""
        said = []
        if not self.proof:
            said.append("no --cluster-secret-file and no --worker-api-key: this router cannot ask a worker to "
                        "prove itself, and sends clients' prompts to whatever answers at a worker's address "
                        "(docs/security.md, a deployment without keys)")
        if config.discovery and self.seal.key is None:
            said.append("--discovery without --cluster-secret-file: the router uses any record found under the "
                        "prefix, so whoever can write to etcd chooses where clients' prompts go")
        return said


def worker_key_middleware(workers, key: Optional[str]):
    """An aiohttp client middleware: ``Authorization: Bearer KEY`` on a call whose origin is the
    address of a proven worker of ``workers`` (a ``WorkerSet``), on no other; a caller's own
    ``Authorization`` header is dropped first, so nothing else ever carries it to a worker. Never
    on ``/health`` (open on every worker): that probe is what proves the worker again, so whatever
    now answers at a proven address must not get the key by being asked to prove itself."""
    header = bearer(key) if key else {}

    async def add_worker_key(request, handler):
        request.headers.popall("Authorization", None)
        if header and request.url.path != "/health" and _proven_origin(workers, request.url):
            request.headers.update(header)
        return await handler(request)

    return add_worker_key


def _proven_origin(workers, url: URL) -> bool:
    origin = url.origin()
    return any(w.proven and URL(w.url).origin() == origin for w in workers.all())
