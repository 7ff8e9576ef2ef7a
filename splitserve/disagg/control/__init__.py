"""The control plane: ZMQ sockets between prefill and decode workers, one thread on each side.

Prefill binds one ROUTER socket on its bootstrap port (``prefill_server.py``); decode connects one DEALER
per prefill address and session (``decode_client.py``); what both share — identities, the outbox, fault
injection, liveness, the receive loop no frame can stop — is in ``base.py``. The protocol is in
``docs/protocol.md``.

These threads own their sockets and nothing else. They answer ``GetInfo`` and heartbeats
themselves (so a long forward pass never makes a live peer look dead), send heartbeats every
``heartbeat_interval_s``, and stop doing both while the engine loop is wedged (``loop_alive``),
so that the peer declares us lost, fences us and frees what it held. They post everything else
to the engine loop's inbox as lifecycle events (``FromPeer``, ``PeerInfo``, ``PeerLost``,
``LocalFailure``) and keep the liveness of their peers for the engine loop to take
(``take_heard``). The engine loop sends through ``send``, a queue the thread drains.

Fault injection (off unless configured): drop, delay or duplicate any outgoing control message,
answers and heartbeats included. Whatever may be lost is sent again: ``GetInfo`` and
``RegisterPeer`` until answered, ``RegisterRoom`` and ``AbortRoom`` by the lifecycle.
"""

from splitserve.disagg.control.base import ControlFaults, ControlThread, identity, peer_of
from splitserve.disagg.control.decode_client import DecodeControl
from splitserve.disagg.control.prefill_server import PrefillControl

__all__ = ["ControlFaults", "ControlThread", "DecodeControl", "PrefillControl", "identity", "peer_of"]
