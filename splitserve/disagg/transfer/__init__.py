"""KV transfer between prefill and decode workers: one interface, backends loaded on demand.

``get_backend("nixl" | "tcp" | "fake")`` imports only the backend asked for, so this package
imports on a machine without NIXL. See ``base.py`` for the contract.
"""

from .base import (
    DONE,
    PENDING,
    Handle,
    Span,
    Status,
    TransferBackend,
    TransferState,
    backend_names,
    create_backend,
    failed,
    get_backend,
    page_spans,
)

__all__ = [
    "DONE",
    "PENDING",
    "Handle",
    "Span",
    "Status",
    "TransferBackend",
    "TransferState",
    "backend_names",
    "create_backend",
    "failed",
    "get_backend",
    "page_spans",
]
