"""Worker selection policies: which healthy worker of one role gets the next request.

The router holds one policy object per role (prefill, decode), so round robin alternates within
each role independently. Policies only read the candidates they are given (already filtered to
the healthy ones) and never block.

- ``round_robin``: the next worker in turn (the turn survives workers leaving the rotation).
- ``random``: uniform choice, from the policy's own ``random.Random`` (seedable in tests).
- ``least_load``: the worker with the fewest requests in flight through this router; ties go
  round robin, so idle workers share the load instead of the first one taking everything.
"""

from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

from splitserve.router.workers import Worker


class Policy:
    name = "base"

    def pick(self, workers: Sequence[Worker]) -> Worker:
        """One of ``workers`` (non-empty, all healthy)."""
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._turn = 0

    def pick(self, workers: Sequence[Worker]) -> Worker:
        worker = workers[self._turn % len(workers)]
        self._turn += 1
        return worker


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: Optional[int] = None):
        self._rng = random.Random(seed)

    def pick(self, workers: Sequence[Worker]) -> Worker:
        return self._rng.choice(list(workers))


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self):
        self._tie_break = RoundRobin()

    def pick(self, workers: Sequence[Worker]) -> Worker:
        fewest = min(w.in_flight for w in workers)
        return self._tie_break.pick([w for w in workers if w.in_flight == fewest])


POLICIES: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    RandomChoice.name: RandomChoice,
    LeastLoad.name: LeastLoad,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
