"""A worker's record in discovery (``--discovery``): checked at start (what it leaves open said
then), kept in the store the URL's scheme names (``discovery/backends.py``) once the worker serves,
sealed with the cluster secret's record key when it has one (``discovery/signing.py``)."""

from __future__ import annotations

import logging
from typing import Mapping

from aiohttp import web

from splitserve.config import ServerConfig
from splitserve.discovery import backends as stores
from splitserve.discovery.record import check_url
from splitserve.hosts import url_host
from splitserve.server.state import WorkerState, advertised_host

log = logging.getLogger(__name__)


def check_discovery(config: ServerConfig, backends: Mapping = stores.BACKENDS) -> None:
    """ValueError for a ``--discovery`` this worker cannot register with (``backends``: by scheme)."""
    stores.check(config.discovery, config.discovery_access, backends)
    if config.role not in ("prefill", "decode"):
        raise ValueError("--discovery registers prefill and decode workers (--role prefill|decode)")
    if not config.discovery_ttl_s >= 2 or not config.discovery_grace_s >= 0:
        raise ValueError("--discovery-ttl-s must be at least 2 and --discovery-grace-s at least 0")
    if advertised_host(config) in ("0.0.0.0", "::", ""):
        raise ValueError(f"--discovery: routers cannot reach {config.host}; give --advertise-host (on "
                         "Kubernetes the pod's IP, status.podIP)")
    url = advertised_url(config, config.port or 1, tls=False)
    try:
        check_url(url)
    except ValueError:
        raise ValueError(f"--discovery: this worker would register {url!r}, which no router takes: give "
                         "--advertise-host a host name, an IPv4 address or an IPv6 address (brackets optional, "
                         "no zone id)") from None
    for warning in discovery_warnings(config, backends):
        log.warning("%s", warning)


def advertised_url(config: ServerConfig, port: int, tls: bool) -> str:
    """The URL this worker registers: its ``--advertise-host`` (else ``--host``) as a URL writes it."""
    return f"{'https' if tls else 'http'}://{url_host(advertised_host(config))}:{port}"


def discovery_warnings(config: ServerConfig, backends: Mapping = stores.BACKENDS) -> list[str]:
    """What a worker registering with ``config`` is told at start about what it leaves open."""
    said = stores.check(config.discovery, config.discovery_access, backends)
    if not config.cluster_secret_file:
        said.append("--discovery without --cluster-secret-file: this worker's record goes unsigned; a router "
                    "given --cluster-secret-file drops it, and one without takes any record anyone who can write "
                    "under the prefix puts there (docs/security.md)")
    return [s for s in said if s]


def register(state: WorkerState, runner: web.AppRunner, tls: bool, backends: Mapping = stores.BACKENDS):
    """Keep this worker's record, sealed, in the store of ``--discovery`` (a started registrar:
    ``discovery/backends.py``; ``backends``: by scheme)."""
    from splitserve.discovery.record import WorkerRecord, parse_record
    from splitserve.discovery.signing import RecordSeal

    config, pairing = state.config, state.pairing()
    port = runner.addresses[0][1] if runner.addresses else config.port
    record = WorkerRecord(state.worker_id, state.incarnation, config.role, advertised_url(config, port, tls),
                          pairing["bootstrap_port"], pairing["model_fingerprint"], pairing["protocol_version"],
                          pairing["transfer_backend"])
    record = parse_record(record.to_json())  # in the one form every router reads it in (and checked)
    return stores.register(config.discovery, config.discovery_access, record, config.discovery_ttl_s,
                           RecordSeal(state.keys.record), backends)
