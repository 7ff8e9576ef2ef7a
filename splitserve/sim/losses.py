"""A decode worker lost mid-answer (the ``decode_lost`` fault), and what its requests must end with.

The fault waits (up to ``ARM_S``) until one of its decode's streams has brought its client
``params[1]`` token events, then kills that decode (restarted after the fault's duration) or stops
it (SIGSTOP: nothing of the process runs and nothing it sends arrives until the fault's end; the
kernel still takes connections). The clients it cuts mid-answer — a stream with a token, a whole
answer whose decode leg was open there — are marked; each must then end with the reference tokens
(``run.py`` checks every finished answer) unless the schedule left it no way to be served:

- **no other decode**: every other decode worker was touched by a fault (of any kind, an engine
  that could not schedule included) between the loss and the client's end, give or take the
  settling time;
- **migrations used up**: the client's request was sent to more than ``max_migrations`` decode legs;
- **the deadline**: it ended at the router's ``request_timeout_s`` (less ``DEADLINE_SLACK_S``).

:func:`off_by` is the plant the invariant must catch: the router's continuation resends one token
too few or too many (``Scenario.resend_off_by``, applied on the simulated wire).
"""

from __future__ import annotations

import json
from typing import Optional

ARM_S = 10.0  # a loss not triggered by then does not happen
DEADLINE_SLACK_S = 0.5


def mid_answer(client, slot: str, tokens: int) -> bool:
    """``client``'s answer is under way on decode ``slot``: a stream that has had ``tokens`` token
    events, or a whole answer whose last decode leg went there."""
    if client.eof or client.left is not None or not client.decodes or client.decodes[-1] != slot:
        return False
    return client.token_events >= tokens if client.spec.stream else True


class Losses:
    """The ``decode_lost`` faults of one run (``run.Run`` strikes them, hands each client's chunks
    to :meth:`watch` and asks :meth:`unserved`)."""

    def __init__(self, run):
        self.run = run
        self.armed: list = []  # (fault, until): waiting for a stream of its decode to have its tokens
        self.marked: dict[int, list[tuple[str, float]]] = {}  # client n -> (slot, when) of each loss it was cut by

    def strike(self, fault) -> None:
        self.armed.append((fault, self.run.loop.time() + ARM_S))

    def watch(self, client) -> None:
        """A chunk reached ``client``: an armed loss of its decode whose count it reached strikes
        (just after: never inside the router's write)."""
        if not self.armed or not client.spec.stream:
            return
        now = self.run.loop.time()
        self.armed = [(f, until) for f, until in self.armed if until >= now]
        for fault, until in self.armed:
            if mid_answer(client, fault.target, fault.params[1]):
                self.armed.remove((fault, until))
                self.run.loop.call_soon(self._lose, fault)
                return

    def _lose(self, fault) -> None:
        run, now = self.run, self.run.loop.time()
        worker = run.cluster.workers.get(fault.target)
        mode = fault.params[0]
        if worker is None or not worker.alive or worker.stopped_until > now:
            return
        cut = [c for c in run.clients if mid_answer(c, fault.target, 1)]
        for client in cut:
            self.marked.setdefault(client.spec.n, []).append((fault.target, now))
        run.faults.effects[f"decodes lost mid-stream ({'killed' if mode == 'kill' else 'stopped'})"] += 1
        run.faults.effects["answers cut by a lost decode"] += len(cut)
        run.faults.window(fault.kind, fault.target, now, now + fault.duration)
        run.trace("%s lost mid-answer (%s for %.3fs): clients %s", worker.name, mode, fault.duration,
                  [c.rid for c in cut][:8])
        if mode == "kill":
            worker.kill()
            run.restart_at(fault.target, now + fault.duration)
        else:
            worker.stop(now + fault.duration)

    def unserved(self, client, ended: float, settle: float) -> Optional[str]:
        """Why ``client``, cut by a lost decode and ended with an error that no other fault
        excuses, should have been served (None: the schedule left it no way, or it was not cut)."""
        cuts = self.marked.get(client.spec.n)
        if not cuts:
            return None
        s = self.run.s
        if len(client.decodes) > s.router["max_migrations"] or \
                ended >= client.born + s.end_to_end_s - DEADLINE_SLACK_S:
            return None
        slot, at = cuts[-1]
        others = [f"decode{i}" for i in range(s.decodes) if f"decode{i}" != slot]
        free = [o for o in others if not self.run.faults.excuses({o}, set(), at, ended, settle)]
        if not free:
            return None
        return (f"its decode {slot} was lost at t={at:.3f} with {free} untouched by any fault, "
                f"{len(client.decodes) - 1} of {s.router['max_migrations']} migrations used and its deadline "
                f"t={client.born + s.end_to_end_s:.3f} not passed")


def off_by(body: bytes, k: int) -> bytes:
    """``body`` (a leg's, router to worker) with each continued choice's ids one too few (``k`` <
    0) or the last one twice (``k`` > 0): the plant :class:`Losses`' invariant catches."""
    if not k or b'"continuation"' not in body:
        return body
    data = json.loads(body)
    for choice in data["continuation"]["choices"]:
        ids = choice["ids"]
        choice["ids"] = ids[:-1] if k < 0 else ids + ids[-1:]
    return json.dumps(data).encode()
