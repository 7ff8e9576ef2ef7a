"""A room and a tombstone: the records a room table keeps of one request and of one that ended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from splitserve.disagg.lifecycle.peers import Peer
from splitserve.disagg.lifecycle.states import Ending, State


@dataclass
class Room:
    id: int
    """The room id (``bootstrap_room``, or a negative local one)."""
    rid: str
    prompt_len: int
    n_pages: int
    born: float
    state: State
    entered: float
    """When the room entered ``state``."""
    deadline: Optional[float] = None
    """Live: when the current state times out. Held: when the held timer fires."""
    peer: Optional[Peer] = None
    ending: Optional[Ending] = None
    expires: Optional[float] = None
    """When the request's own deadline passes (``RequestArrived.deadline_s``, and
    ``request_timeout_s``): the earlier of the two; None: neither is set."""


@dataclass(frozen=True)
class Tombstone:
    """A room id that ended, or was aborted before its request came (``arrived`` False). ``peer``
    and ``answer``: whom the room was for, and what to tell that peer again if it asks again
    (prefill: the ``KVDone`` of a finished room, in case the first one was lost)."""

    ending: Ending
    arrived: bool
    peer: Optional[Peer] = None
    answer: Any = None
