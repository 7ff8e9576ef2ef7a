"""What a worker's HTTP handlers share: one :class:`WorkerState` on the app (``STATE``), holding
the engine, the config, the metrics, the requests in flight and the role switch under way (no
module-level globals)."""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from aiohttp import web

from splitserve.auth import parse_allowed_prefill
from splitserve.config import ServerConfig
from splitserve.engine.grammar_compiler import GrammarCompiler
from splitserve.metrics import Registry
from splitserve.server.identity_proof import WorkerKeys
from splitserve.server.tokenize_lanes import TokenizeLanes
from splitserve.server.worker_metrics import WorkerMetrics


def advertised_host(config: ServerConfig) -> str:
    """The host routers and peers reach this worker at: ``--advertise-host``, else ``--host``."""
    return config.advertise_host if config.advertise_host is not None else config.host


def check_identity(config: ServerConfig) -> None:
    """ValueError for a ``--worker-id`` or ``--advertise-host`` given but unusable (empty
    included: a value left out means the default, an empty one is a mistake to name)."""
    from splitserve.discovery.record import check_id

    if config.worker_id is not None:
        check_id(config.worker_id, "--worker-id")
    if config.advertise_host is not None and not config.advertise_host.strip():
        raise ValueError("--advertise-host: empty; give the host routers reach this worker at, or leave it out")


class WorkerState:
    """Everything the handlers share: the engine, config, metrics and requests in flight."""

    def __init__(self, engine, config: ServerConfig, registry: Registry, incarnation: Optional[str] = None):
        from splitserve.disagg.bootstrap import new_incarnation
        from splitserve.discovery.record import check_id, default_worker_id

        self.engine = engine
        self.worker_id = check_id(config.worker_id if config.worker_id is not None else default_worker_id(
            config.role, advertised_host(config), config.port), "--worker-id")
        self.incarnation = incarnation or new_incarnation()
        """This process start's id: the one its control plane uses (``make_engine`` is given it)."""
        self.config = config
        self.registry = registry
        self.metrics = WorkerMetrics(registry, engine, config.role)
        self.draining = False
        self.started_at = int(time.time())
        self.inflight: set[asyncio.Task] = set()  # generation handlers now running
        self.tokenize = TokenizeLanes()  # validation and tokenization, off the event loop
        self.grammars = GrammarCompiler()  # response_format, compiled off the lanes
        self.allowed_prefill = parse_allowed_prefill(config.allowed_prefill)  # whose bootstrap fields decode takes
        self.epoch = 0
        """One more at every role switch begun (``POST /role``: a request names the epoch it expects)."""
        self.switch: Optional[asyncio.Future] = None  # the role switch under way
        self.switch_to: Optional[str] = None
        self.register = None
        """``--discovery``: puts this worker's record as it is now in etcd (a started ``Registration``)."""
        self.registration = None  # the record in etcd now, if any
        self.stopping = False  # SIGTERM: draining for good (a role switch under way does not undo it)
        self.keys = WorkerKeys.of(config)  # what it proves itself to a router with, and seals its record with

    def identity(self) -> dict:
        """Who this worker is (on ``/health`` and ``/get_server_info``): id, incarnation, role, and
        the epoch of its role (``POST /role``)."""
        return {"id": self.worker_id, "incarnation": self.incarnation, "role": self.config.role, "epoch": self.epoch}

    def pairing(self) -> dict:
        """What a router pairs workers by (``/get_server_info``): the model fingerprint, the control
        protocol version, the transfer backend and, for a prefill, its bootstrap port. Empty until
        the role started (a colocated worker has none)."""
        info = getattr(getattr(self.engine, "role", None), "info", None)
        if info is None:
            return {}
        return {"model_fingerprint": info.model, "protocol_version": info.protocol_version,
                "transfer_backend": info.backend,
                "bootstrap_port": self.config.bootstrap_port if self.config.role == "prefill" else None}

    @property
    def leaving(self) -> bool:
        """Out of discovery on its way out (its record revoked at SIGTERM or for a role switch): it
        still serves what routers sent, and says so on ``/health`` so that they send nothing new."""
        return self.register is not None and self.registration is None

    def accepting(self) -> bool:
        return bool(self.engine.ready) and not self.draining and not self.engine.draining

    @property
    def model_name(self) -> str:
        """``--served-model-name``, else the built-in model's name (``tiny``, ``smollm2``), else the
        checkpoint folder's basename (a GGUF file's stem)."""
        from splitserve.models.resolve import BUILTIN_MODELS

        if self.config.served_model_name:
            return self.config.served_model_name
        if getattr(self.engine.config, "model", None) in BUILTIN_MODELS:
            return self.engine.config.model
        return self.engine.spec.name


STATE = web.AppKey("splitserve_worker", WorkerState)
