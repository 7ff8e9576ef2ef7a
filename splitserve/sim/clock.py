"""Simulated time and randomness: one asyncio event loop whose clock is virtual, and random
streams derived from the seed by name.

:class:`SimLoop` (``asyncio_internals.py``, the one module that reaches into asyncio's and
aiohttp's private parts) is an ``asyncio`` selector loop whose ``time()`` is a number the loop moves
itself: when nothing is ready to run it jumps straight to the next timer instead of sleeping.
Everything in a simulated cluster runs on it — the router's and the workers' coroutines (the real
ones, ``asyncio.wait_for`` and ``call_later`` included) and the callbacks that stand for each
worker's threads — so a run is one thread, the order of events is the loop's (timers by time,
then in the order they were made), and an hour of bad luck takes as long as its events take.
No file descriptor is ever polled.

:class:`Streams` gives each part of the simulation its own ``random.Random``, seeded from the run's
seed and the part's name (with a stable hash: never Python's ``hash``, which differs per
process), so that the same seed gives the same run in any process.
"""

from __future__ import annotations

import hashlib
import random

from splitserve.sim.asyncio_internals import Idle, InlineExecutor, SimLoop  # noqa: F401 (the loop is the clock)


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from ``parts`` (their ``str``), the same in every process."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Streams:
    """Named random streams of one run: ``streams("network")`` is the same generator for the same
    seed and name, whatever else the run draws."""

    def __init__(self, seed: int):
        self.seed = seed
        self._streams: dict[str, random.Random] = {}

    def __call__(self, name: str) -> random.Random:
        rng = self._streams.get(name)
        if rng is None:
            rng = self._streams[name] = random.Random(stable_seed(self.seed, name))
        return rng
