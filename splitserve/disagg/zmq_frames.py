"""How big a ZMQ frame a socket takes, CURVE's own bytes counted: shared by the control sockets
(``control/``) and the tcp transfer (``transfer/tcp.py``), which both may run under the cluster
secret's CURVE (``control/curve.py``)."""

from __future__ import annotations

from typing import Any, Optional

CURVE_FRAME_OVERHEAD = 33
"""Bytes CURVE adds to every frame on the wire: a MESSAGE command (its 8-byte name, an 8-byte
nonce, a flags byte) and the box's 16-byte tag. ZMQ's ``MAXMSGSIZE`` counts the wire frame, so a
CURVE socket that takes frames of up to N bytes allows N plus this (:func:`max_msg_size`); one
that allows exactly N drops a frame of N bytes, and the connection that carried it."""


def max_msg_size(nbytes: int, secret: Optional[Any]) -> int:
    """The ``MAXMSGSIZE`` of a socket that takes frames of up to ``nbytes`` bytes (CURVE with
    ``secret``, a ``control/curve.ClusterSecret``; None: plain)."""
    return nbytes + (CURVE_FRAME_OVERHEAD if secret is not None else 0)
