"""The transfer backends by name: the one list that a flag, a discovery record, ``launch`` and the
worker check, kept below everything that names one. The classes live in ``disagg/transfer/`` and
are imported only when used (``disagg/transfer/base.get_backend``), so a machine without NIXL can
still use tcp."""

from __future__ import annotations

BACKENDS = {
    "nixl": "splitserve.disagg.transfer.nixl:NixlBackend",
    "tcp": "splitserve.disagg.transfer.tcp:TcpBackend",
    "fake": "splitserve.disagg.transfer.fake:FakeBackend",
}
"""name -> ``module:class`` of every backend."""

SERVED = ("nixl", "tcp")
"""What a worker serves with (``--transfer-backend``); ``fake`` is the simulator's and the tests'."""


def check_served(name: object, what: str = "--transfer-backend") -> str:
    """``name`` if a worker may serve with it, else ValueError naming ``what`` and the choices."""
    if name not in SERVED:
        raise ValueError(f"{what} must be one of {', '.join(SERVED)}, not {name!r}")
    return name
