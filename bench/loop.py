"""The engine loop's cost per iteration with 10^5 lifecycle entries held against none, in one run.

Two prefill workers of the tiny model run in this process, each with its real engine loop body,
room table, control thread (ZMQ) and transfer thread (tcp backend). A fake decode session speaks to
each over its real bootstrap port; the receiving link it registers is a socket that takes frames
and never answers, so writes stay in flight and never settle. Into one of them the bench puts, through the control plane:

* pending registrations (``RegisterRoom`` frames for rooms whose request never comes),
* tombstones (``AbortRoom`` frames for rooms not seen),
* held rooms (registered requests whose forward pass ran and whose writes never settle, then
  aborted by their client: terminal, still holding their pages),

10^5 entries in all, with deadlines long enough that none expires during the run. The other stays
empty. Then both run the same iterations of the engine loop (``AsyncEngine.iterate_once``, here without waiting: the
inbox, ``tick``, a step when there is work), in two workloads: idle (nothing to do) and a trickle
(one new registered request per iteration, so the table, the scheduler and a forward pass run).
It prints the time per iteration of each and the ratio (target: <= 1.1x). Usage::

    .venv/bin/python bench/loop.py [--entries 100000] [--iterations 2000]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import zmq

from splitserve.config import EngineConfig, ServerConfig
from splitserve.disagg import protocol as p
from splitserve.disagg.control import identity
from splitserve.disagg.lifecycle import Deadlines, Peer
from splitserve.disagg.prefill_role import PrefillRole
from splitserve.disagg.transfer.base import encode_metadata
from splitserve.disagg.transfer.tcp import PROTOCOL as TCP_PROTOCOL
from splitserve.engine.async_engine import AbortRequest, AddRequest, AsyncEngine
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import Bootstrap, GenerateRequest, SamplingParams

from procs import free_port

LONG = Deadlines(bootstrap_s=3000, queue_s=3000, prefill_stall_s=3000, transfer_floor_s=3000, write_drain_s=3000,
                 prealloc_s=3000, kv_wait_s=3000, decode_stall_s=3000, pending_registration_s=3000,
                 heartbeat_interval_s=1, heartbeat_misses=3000, tombstone_s=9000)
PROMPT = 8  # tokens: one page



class Worker:
    """A prefill worker without HTTP, whose engine loop the bench runs by hand."""

    def __init__(self, port: int, bootstrap_port: int, held_rooms: int):
        pages = held_rooms + 4096
        config = EngineConfig(model="tiny", page_size=PROMPT, max_total_tokens=pages * PROMPT,
                              max_running_requests=256, max_waiting_requests=10**6, max_batch_tokens=2048)
        server = ServerConfig(role="prefill", port=port, bootstrap_port=bootstrap_port, transfer_backend="tcp")
        self.loop = AsyncEngine(config, PrefillRole(server, LONG), loop_stall_s=3000)
        self.loop.engine = LLMEngine(config)
        self.loop.role.start(self.loop)  # its control and transfer threads; the loop itself runs here
        self.loop.ready = True
        self.role = self.loop.role
        self.ctx = zmq.Context.instance()
        self.hole = self.ctx.socket(zmq.ROUTER)  # the decode's link: takes frames, never answers
        self.hole.setsockopt(zmq.LINGER, 0)
        hole_port = self.hole.bind_to_random_port("tcp://127.0.0.1")
        link = f"bench-link-{port}"
        metadata = encode_metadata("tcp", link, 1 << 30, protocol=TCP_PROTOCOL, endpoint=f"tcp://127.0.0.1:{hole_port}",
                                   max_frame=4 << 20, max_notif=64 << 10)
        self.decode = Peer("bench-decode:1", f"bd{port}", 1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity(self.decode))
        self.sock.connect(f"tcp://127.0.0.1:{bootstrap_port}")
        self.send(p.RegisterPeer(self.decode.incarnation, self.role.incarnation, link, metadata))
        self.wait(lambda: self.role.control.sizes()["sessions"] == 1, "the decode session registers")
        self.rooms = itertools.count(1)

    def send(self, msg) -> None:
        self.sock.send(p.encode(msg))

    def iterate(self) -> None:
        self.loop.iterate_once(wait=False)

    def wait(self, check, what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not after {timeout}s")
            self.iterate()

    def register(self, room: int) -> None:
        self.send(p.RegisterRoom(room, self.decode.incarnation, self.role.incarnation, f"r{room}", PROMPT, [room % 1024], 0))

    def request(self, room: int) -> str:
        rid = f"r{room}"
        req = GenerateRequest(rid, tuple(range(10, 10 + PROMPT)), SamplingParams(max_tokens=1, temperature=0),
                              Bootstrap("127.0.0.1", 1, room))
        self.loop.post_event(AddRequest(req))
        return rid

    def counts(self) -> dict:
        return self.role.table.counts_by_state()

    def fill(self, entries: int, held: int) -> None:
        """``held`` held rooms, then pending registrations and tombstones for the rest."""
        for _ in range(held):
            room = next(self.rooms)
            self.register(room)
            self.request(room)
        self.wait(lambda: self.counts()["TRANSFERRING"] == held, f"{held} rooms transferring (stalled)")
        for room in range(1, held + 1):
            self.loop.post_event(AbortRequest(f"r{room}"))
        self.wait(lambda: self.counts()["held_writes"] == held, f"{held} rooms held")
        rest = entries - held
        for _ in range(rest // 2):
            self.register(next(self.rooms))
        for _ in range(rest - rest // 2):
            self.send(p.AbortRoom(next(self.rooms) + 10**12, self.decode.incarnation, "client_abort"))
        self.wait(lambda: self.entries() >= entries, f"{entries} lifecycle entries")

    def entries(self) -> int:
        c = self.counts()
        return c["held_writes"] + c["pending_registrations"] + c["tombstones"]

    def close(self) -> None:
        self.sock.close(0)
        self.role.close()
        self.hole.close(0)


def chunk(worker: Worker, trickle: bool, n: int = 20) -> float:
    """Seconds per iteration over ``n`` iterations."""
    t0 = time.perf_counter()
    for _ in range(n):
        if trickle:
            room = next(worker.rooms) + 10**13
            worker.register(room)
            worker.request(room)
        worker.iterate()
    return (time.perf_counter() - t0) / n


def compare(empty: Worker, full: Worker, iterations: int, trickle: bool) -> tuple[float, float]:
    """Median seconds per iteration of each, their chunks interleaved (so that a busy moment of
    the machine falls on both alike)."""
    e, f = [], []
    for _ in range(max(1, iterations // 20)):
        e.append(chunk(empty, trickle))
        f.append(chunk(full, trickle))
    return statistics.median(e), statistics.median(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--held", type=int, default=5_000, help="how many of the entries are held rooms")
    ap.add_argument("--iterations", type=int, default=2000)
    args = ap.parse_args()
    empty = Worker(free_port(), free_port(), held_rooms=0)
    full = Worker(free_port(), free_port(), held_rooms=args.held)
    try:
        t0 = time.perf_counter()
        full.fill(args.entries, args.held)
        print(f"filled in {time.perf_counter() - t0:.1f}s (wall): {full.counts()}")
        compare(empty, full, 100, trickle=True)  # warm up both the same way
        rows = [(workload, *compare(empty, full, args.iterations, trickle))
                for workload, trickle in (("idle", False), ("trickle", True))]
        print(f"per engine-loop iteration, median of interleaved chunks of 20 ({args.iterations} iterations each):")
        for workload, e, f in rows:
            print(f"  {workload:>7}: no entries {e * 1e6:9.1f} us   {full.entries():,} entries {f * 1e6:9.1f} us   "
                  f"ratio {f / e:.2f}x")
    finally:
        empty.close()
        full.close()


if __name__ == "__main__":
    main()
