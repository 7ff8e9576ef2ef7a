"""A new cluster secret in a file only its owner can read: what ``splitserve launch``, the tests and
the benches hand their workers as ``--cluster-secret-file``. Apart from the control plane's
CurveZMQ code (``disagg/control/curve.py``, which reads such files), so that writing one loads no
model code: ``launch``'s supervisor stays a small process."""

from __future__ import annotations

import os
import secrets

MIN_SECRET_BYTES = 32
"""A cluster secret holds at least this many random bytes (``curve.parse_secret`` refuses fewer)."""


def write_secret_file(path: str) -> str:
    """A new cluster secret (``MIN_SECRET_BYTES`` random bytes, hex) in a new file ``path`` that only
    we can read (mode 0600, never world-readable even for a moment); ``path``, for ``--cluster-secret-file``."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(MIN_SECRET_BYTES) + "\n")
    return str(path)
