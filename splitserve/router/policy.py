"""Worker selection policies: which healthy worker of one role gets the next request.

The router holds one policy object per role (prefill, decode), so round robin alternates within
each role independently. Policies only read the candidates they are given (already filtered to
the healthy ones) and never block.

- ``round_robin``: the next worker in turn (the turn survives workers leaving the rotation).
- ``random``: uniform choice, from the policy's own ``random.Random`` (seedable in tests).
- ``least_load``: the worker with the fewest requests in flight through this router; ties go
  round robin, so idle workers share the load instead of the first one taking everything.
- ``cache_aware``: the worker most likely to hold the request's prefix in its KV prefix cache,
  unless the load is out of balance (:class:`CacheAware`).

Every policy is handed the request's routing key (its prompt as text, or its token ids written
as text: the router has no tokenizer) with the candidates; only ``cache_aware`` reads it. The
router tells every policy when a worker leaves its set (:meth:`Policy.forget`).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from splitserve.router.workers import Worker


class Policy:
    name = "base"

    def pick(self, workers: Sequence[Worker], key: str = "") -> Worker:
        """One of ``workers`` (non-empty, all healthy) for a request whose routing key is ``key``."""
        raise NotImplementedError

    def forget(self, worker: Worker) -> None:
        """``worker`` left the router's set: drop what is kept for it."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._turn = 0

    def pick(self, workers: Sequence[Worker], key: str = "") -> Worker:
        worker = workers[self._turn % len(workers)]
        self._turn += 1
        return worker


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: Optional[int] = None):
        self._rng = random.Random(seed)

    def pick(self, workers: Sequence[Worker], key: str = "") -> Worker:
        return self._rng.choice(list(workers))


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self):
        self._tie_break = RoundRobin()

    def pick(self, workers: Sequence[Worker], key: str = "") -> Worker:
        fewest = min(w.in_flight for w in workers)
        return self._tie_break.pick([w for w in workers if w.in_flight == fewest])


@dataclass(frozen=True)
class CacheKnobs:
    """The knobs of ``cache_aware`` (``splitserve router --cache-*``; defaults there)."""

    block_chars: int = 64
    threshold: float = 0.3
    balance_abs: int = 4
    balance_rel: float = 1.5
    index_blocks: int = 100_000


class CacheAware(Policy):
    """Route by the longest prefix of the request already sent to a worker, balanced against load.

    The router cannot see a worker's cache, nor tokenize, so it keeps for each worker an
    approximate index of the routing keys it recently sent there: each key cut into blocks of
    ``block_chars`` characters, every block named by a hash chaining it with the blocks before it
    (so a block matches only after the same prefix), the last ``index_blocks`` blocks per worker
    kept (least recently used dropped). For a request, each candidate's match is the number of
    its leading blocks that worker has seen. Then:

    1. load out of balance — the busiest candidate has more than ``balance_abs`` requests in
       flight more than the least busy *and* more than ``balance_rel`` times as many: the least
       busy one (load wins);
    2. else the best match, if it covers at least ``threshold`` of the key (ties: least busy);
    3. else the least busy one.

    The chosen worker's index then learns the key. An index belongs to a worker's identity
    (:attr:`Worker.key`, its id and incarnation), not to its address: a worker restarted (a new
    incarnation, its cache empty) or replaced by another at the same URL starts with an empty
    index, and a worker's index is dropped when it leaves the set (:meth:`forget`).
    """

    name = "cache_aware"

    def __init__(self, knobs: CacheKnobs = CacheKnobs()):
        self.knobs = knobs
        self._seen: dict[str, OrderedDict[bytes, None]] = {}  # Worker.key -> block hashes, oldest first
        self._keys: dict[int, str] = {}  # Worker.serial -> the key its index is under
        self._least = LeastLoad()

    def blocks(self, key: str) -> list[bytes]:
        size, prev, out = self.knobs.block_chars, b"", []
        for i in range(0, len(key) - len(key) % size, size):
            prev = hashlib.blake2b(prev + key[i:i + size].encode("utf-8", "surrogatepass"), digest_size=12).digest()
            out.append(prev)
        return out

    def _index(self, worker: Worker) -> Optional[OrderedDict[bytes, None]]:
        key, before = worker.key, self._keys.get(worker.serial)
        if before != key:  # first seen, or the same worker object with a new incarnation: its old cache is gone
            self.forget(worker)
            self._keys[worker.serial] = key
        return self._seen.get(key)

    def forget(self, worker: Worker) -> None:
        key = self._keys.pop(worker.serial, None)
        if key is not None and key not in self._keys.values():  # two objects of one identity share its index
            self._seen.pop(key, None)

    def match(self, worker: Worker, blocks: list[bytes]) -> int:
        seen = self._index(worker)
        n = 0
        while seen is not None and n < len(blocks) and blocks[n] in seen:
            n += 1
        return n

    def pick(self, workers: Sequence[Worker], key: str = "") -> Worker:
        blocks = self.blocks(key)
        loads = [w.in_flight for w in workers]
        k = self.knobs
        if max(loads) - min(loads) > k.balance_abs and max(loads) > k.balance_rel * min(loads):
            chosen = self._least.pick(workers)
        else:
            matches = [self.match(w, blocks) for w in workers]
            best = max(matches)
            if blocks and best >= k.threshold * len(blocks) and best > 0:
                chosen = self._least.pick([w for w, m in zip(workers, matches) if m == best])
            else:
                chosen = self._least.pick(workers)
        self._learn(chosen, blocks)
        return chosen

    def _learn(self, worker: Worker, blocks: list[bytes]) -> None:
        seen = self._index(worker)
        if seen is None:
            seen = self._seen[worker.key] = OrderedDict()
        for b in blocks:
            seen[b] = None
            seen.move_to_end(b)
        while len(seen) > self.knobs.index_blocks:
            seen.popitem(last=False)


POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: RoundRobin,
    RandomChoice.name: RandomChoice,
    LeastLoad.name: LeastLoad,
    CacheAware.name: CacheAware,
}


def make_policy(name: str, knobs: Optional[CacheKnobs] = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(knobs or CacheKnobs()) if cls is CacheAware else cls()


def routing_key(validated) -> str:
    """What ``cache_aware`` matches a request by: its prompt as the client sent it — text, chat
    messages (role and content, in order), or token ids written as text."""
    if validated.prompt_ids is not None:
        return " ".join(map(str, validated.prompt_ids)) + " "
    if validated.messages is not None:
        return "".join(f"<{m['role']}>{m['content']}" for m in validated.messages)
    return validated.prompt_text or ""
