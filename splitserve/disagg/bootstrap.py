"""Bootstrap info: what a prefill worker tells decode workers about itself, and the check that
decode runs before sending anything (DESIGN §3).

Two workers can exchange KV pages only if they agree on everything that shapes a page: the model,
its layers, KV heads and head dim, the dtype, the page size, and the transfer backend (and the
control protocol version). :func:`first_mismatch` names the first field that differs, with both
values, so an ``incompatible_peer`` failure says exactly what to fix.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Optional

from splitserve.disagg.protocol import PROTOCOL_VERSION, Info
from splitserve.engine.kv_pool import KVLayout

COMPARED_FIELDS = ("protocol_version", "model", "num_layers", "num_kv_heads", "head_dim", "dtype", "page_size",
                   "backend")


def new_incarnation() -> str:
    """A fresh id for this process start: a peer restarted on the same address is a new peer."""
    return uuid.uuid4().hex[:16]


def model_identity(spec) -> str:
    """The architecture plus a fingerprint of config.json: same checkpoint, same identity."""
    config = Path(spec.path) / "config.json"
    try:
        digest = hashlib.sha256(json.dumps(json.loads(config.read_text()), sort_keys=True).encode()).hexdigest()[:12]
    except OSError:
        digest = "unknown"
    return f"{spec.architecture}:{digest}"


def local_info(spec, layout: KVLayout, backend: str, incarnation: str) -> Info:
    return Info(protocol_version=PROTOCOL_VERSION, incarnation=incarnation, model=model_identity(spec),
                num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                dtype=str(layout.dtype).removeprefix("torch."), page_size=layout.page_size, backend=backend)


def first_mismatch(ours: Info, theirs: Info) -> Optional[str]:
    """``"page_size (ours 16, peer's 32)"`` for the first field that differs, or None."""
    for name in COMPARED_FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            return f"{name} (ours {a}, peer's {b})"
    return None
