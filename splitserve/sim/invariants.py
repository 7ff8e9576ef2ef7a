"""What must hold in every simulated run, checked while it runs (not only at its end); the full list
with what each means is ``docs/lifecycle.md``, *Invariants*.

After every engine-loop iteration of every worker: **pages conserved** (the allocator's account,
owned pages equal to what the rooms hold; every 16th iteration also no page held twice or both
held and free; decode's quarantine counter), **records agree with the table** (the glue of
``disagg/role.py``), and **no live room past its end-to-end deadline**.

On every event where it can go wrong: **no write lands in a page its room does not own** (a
landing page's slots hold the KV of that room's prompt: ``model.chain``), **no page is handed to a
new room while a write for an old room may land in it**, and **decode starts from its own
prompt's KV**.

For clients (``workload.py``): **exactly one ending** each; no client waits past the router's
``request_timeout_s`` plus ``CLIENT_SLACK_S``; a finished greedy answer is the reference text;
**liveness** (a request failed without an excuse is a violation); the bounds around a **wedged**
engine loop. At the end, once idle: every table idle and record gone, **free pages back to
total**, **per-peer tables bounded**, and **the router's outcome counters equal the endings the
clients saw**.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Optional

from splitserve.disagg.lifecycle import DecodeState
from splitserve.disagg.lifecycle.states import is_terminal
from splitserve.sim.model import chain, kv_of

CLIENT_SLACK_S = 1.0
FULL_CHECK_EVERY = 16


class Violation(Exception):
    """An invariant broke (the first one ends the run)."""


class Checker:
    def __init__(self, config, trace):
        self.config = config
        self.trace = trace
        self.violations: list[str] = []
        self.cluster = None
        self.loop = None
        self.checks = 0
        self._iterations: dict[str, int] = {}
        self._endings: dict[str, dict[int, tuple]] = {}  # worker -> room -> its first terminal (state, ending)

    def violation(self, message: str) -> None:
        now = self.loop.time() if self.loop is not None else 0.0
        self.violations.append(f"t={now:.4f} {message}")
        self.trace(f"VIOLATION {message}")
        if self.loop is not None:
            self.loop.stop()

    # -- hooks a worker installs ---------------------------------------------------------------

    def on_worker(self, worker) -> None:
        engine = worker.ae.engine
        if worker.kind == "decode":
            allocate = engine.allocator.allocate

            def checked_allocate(n, after=None):
                pages = allocate(n, after)
                self._pages_handed_out(worker, pages)
                return pages

            engine.allocator.allocate = checked_allocate
            start_decoding = engine.start_decoding

            def checked_start(req, pages, first_token, **kw):
                self._decode_starts(worker, req, pages)
                return start_decoding(req, pages, first_token, **kw)

            engine.start_decoding = checked_start

    def _pages_handed_out(self, worker, pages: list[int]) -> None:
        if not pages:
            return
        given = set(pages)
        page_nbytes = worker.ae.engine.layout.page_nbytes
        for flight in worker.cluster.tnet.landable_into(worker):
            hit = given & set(_pages_of(flight, page_nbytes))
            if hit:
                self.violation(f"{worker.name}: pages {sorted(hit)} handed to a new room while a write from "
                               f"{flight.writer.name} may still land in them")
                return

    def _decode_starts(self, worker, req, pages: list[int]) -> None:
        n = len(req.prompt_ids)
        keys, values = kv_of(worker.ae.engine.kv, pages, n)
        want = chain(req.prompt_ids)
        if keys != want or values != [float(i) for i in range(n)]:
            bad = next(i for i in range(n) if keys[i] != want[i] or values[i] != i)
            self.violation(f"{worker.name}: room {req.bootstrap.room} starts decoding from KV that is not its "
                           f"prompt's (slot {bad} of {n}: key {keys[bad]:.0f} for {want[bad]:.0f}, position "
                           f"{values[bad]:.0f})")

    def on_land(self, flight, target) -> None:
        """Every page a landing write touches is owned by a room on ``target`` and, unless that room
        is quarantined (its own late write), holds the KV of that room's prompt at those positions."""
        layout = target.ae.engine.layout
        page_nbytes, size = layout.page_nbytes, layout.page_size
        owners = _page_owners(target.role)
        for span, data in zip(flight.handle.spans, flight.data):
            first = span.remote_offset // page_nbytes
            for k in range(span.nbytes // page_nbytes):
                page = first + k
                owner = owners.get(page)
                if owner is None:
                    self.violation(f"{target.name}: a write from {flight.writer.name} lands in page {page}, which "
                                   f"no room holds")
                    return
                room, rec, index = owner
                if rec.quarantined or index is None:
                    continue
                prompt = rec.req.prompt_ids
                want = chain(prompt)
                for slot in range(size):
                    pos = index * size + slot
                    if pos >= len(prompt):
                        break
                    key, value = struct.unpack_from("<d", data, k * page_nbytes + slot * 8)[0], \
                        struct.unpack_from("<d", data, k * page_nbytes + (size + slot) * 8)[0]
                    if key != want[pos] or value != pos:
                        self.violation(f"{target.name}: a write from {flight.writer.name} lands in page {page} of "
                                       f"room {room} with KV that is not its prompt's (position {pos}: key "
                                       f"{key:.0f} for {want[pos]:.0f}, position {value:.0f})")
                        return

    # -- after every engine-loop iteration -------------------------------------------------------

    def after_iteration(self, worker, now: float) -> None:
        self.checks += 1
        rooms = worker.role.table.rooms()
        why, held, quarantined = self._records(worker, rooms)
        for check in (lambda: why, lambda: self._sequences(worker),
                      lambda: self._conserved(worker, held, quarantined),
                      lambda: self._terminal_kept(worker, rooms), lambda: self._in_time(worker, rooms, now)):
            why = check()
            if why is not None:
                self.violation(f"{worker.name}: {why}")
                return
        n = self._iterations[worker.name] = self._iterations.get(worker.name, 0) + 1
        if n % FULL_CHECK_EVERY == 0:
            self._pages_disjoint(worker)
            endings = self._endings[worker.name]
            for room in [room for room in endings if room not in rooms]:  # released: its tombstone answers now
                del endings[room]

    @staticmethod
    def _records(worker, rooms: dict) -> tuple[Optional[str], int, int]:
        """Each room's record against its room: (what is wrong or None, the page references the
        records hold, the pages quarantined rooms hold)."""
        held = 0  # references: a page of the prefix cache may be held by several rooms
        quarantined = 0
        for room, rec in worker.role.rooms.items():
            n = len(rec.pages) + (len(rec.seq.pages) if rec.seq is not None else 0)
            held += n
            r = rooms.get(room)
            live = r is not None and not is_terminal(r.state)
            if rec.want_pages and not (live and r.state is DecodeState.PREALLOC):
                return (f"room {room} waits in the page queue although it is {'gone' if r is None else r.state}",
                        held, quarantined)
            if n and r is None:
                return f"room {room} holds {n} pages the table no longer knows of (nothing will free them)", held, quarantined
            if not rec.answered and r is not None and not live:
                return f"room {room} ended ({r.ending}) but its request was not answered", held, quarantined
            if rec.quarantined:
                quarantined += len(rec.pages)
                if live:
                    return f"room {room} has quarantined pages while live ({r.state})", held, quarantined
        return None, held, quarantined

    @staticmethod
    def _sequences(worker) -> Optional[str]:
        """Every sequence the engine runs is a room's here."""
        for rid, seq in worker.ae.engine.sequences().items():
            rec = worker.role.rooms.get(seq.room) if seq.room is not None else None
            if rec is None or rec.seq is not seq:
                return (f"the engine runs sequence {rid} of room {seq.room}, which no record holds (the pages it "
                        f"takes are no one's)")
        return None

    @staticmethod
    def _conserved(worker, held: int, quarantined: int) -> Optional[str]:
        """The allocator's account is free + cached + owned = total by construction; what must hold
        is that the owned pages are what the rooms hold: one reference per holder of a shared page."""
        alloc = worker.ae.engine.allocator
        shared = [n for n in alloc.refcounts().values() if n]
        owned_refs = alloc.num_owned - len(shared) + sum(shared)
        if held != owned_refs:
            return (f"pages not conserved: the rooms hold {held} page references, the allocator counts "
                    f"{alloc.num_owned} owned ({len(shared)} of them shared, {sum(shared)} references) beside "
                    f"{alloc.num_free} free and {alloc.num_cached} cached of {alloc.num_pages}")
        if worker.kind == "decode" and worker.role.pages_quarantined != quarantined:
            return f"{worker.role.pages_quarantined} pages counted quarantined, {quarantined} held by quarantined rooms"
        return None

    def _terminal_kept(self, worker, rooms: dict) -> Optional[str]:
        """A room that ended stays ended, with the ending it had (rule 2)."""
        endings = self._endings.setdefault(worker.name, {})
        for room, r in rooms.items():
            if is_terminal(r.state):
                first = endings.get(room)
                if first is None:
                    first = endings[room] = (r.state, r.ending)
                    self.trace("%s: room %d (%s) ended %s", worker.name, room, r.rid, r.ending)
                if first[0] is not r.state or first[1] is not r.ending:
                    return (f"room {room} ended {first[0]} ({first[1]}) and then became {r.state} ({r.ending}): a "
                            f"terminal state overwritten")
            elif room in endings:
                return f"room {room} ended {endings[room][0]} and is live again ({r.state})"
        return None

    def _in_time(self, worker, rooms: dict, now: float) -> Optional[str]:
        """No live room outlives ``request_timeout_s``."""
        limit = self.config.deadlines.request_timeout_s
        for room in worker.role.table.live_rooms() if limit else ():
            r = rooms[room]
            if r.born + limit < now - 1e-6:
                return (f"room {room} is {r.state} {now - r.born:.3f}s after its arrival, past request_timeout_s "
                        f"{limit:g}")
        return None

    def _pages_disjoint(self, worker) -> None:
        """No page held by two rooms unless it is a shared page of the prefix cache (and then its
        reference count is its holders), none both held and free or evictable."""
        alloc = worker.ae.engine.allocator
        refs = alloc.refcounts()
        holders: dict[int, list[int]] = {}
        for room, rec in worker.role.rooms.items():
            for page in rec.pages + (rec.seq.pages if rec.seq is not None else []):
                holders.setdefault(page, []).append(room)
        for page, rooms in holders.items():
            if alloc.is_free(page) or alloc.is_evictable(page):
                self.violation(f"{worker.name}: page {page} is {'free' if alloc.is_free(page) else 'evictable'} "
                               f"and held by rooms {rooms}")
                return
            if len(rooms) > 1 and (not alloc.is_cached(page) or refs[page] != len(rooms)):
                self.violation(f"{worker.name}: page {page} held by rooms {rooms}"
                               f"{' with ' + str(refs[page]) + ' references' if alloc.is_cached(page) else ''}")
                return

    # -- at the end ------------------------------------------------------------------------------

    def at_rest(self, cluster) -> None:
        """Every client is done and the cluster has been quiet for ``tombstone_s`` + the peer
        silence bound: nothing may be left."""
        live_decodes = {w.incarnation for w in cluster.workers.values() if w.alive and w.kind == "decode"}
        for worker in cluster.workers.values():
            if not worker.alive:
                continue
            role, table = worker.role, worker.role.table
            alloc = worker.ae.engine.allocator
            if role.rooms or not table.is_idle():
                self.violation(f"{worker.name}: not idle at rest: {len(role.rooms)} records "
                               f"{_describe_records(role)}, table {table.counts_by_state()}, "
                               f"peers {table.peers.counts()}")
                return
            worker.ae.engine.flush_cache()  # what POST /flush_cache has the loop do
            if alloc.num_free != alloc.num_pages:
                self.violation(f"{worker.name}: {alloc.num_pages - alloc.num_free} pages not free at rest, the "
                               f"prefix cache flushed ({alloc.num_cached} cached, {alloc.num_owned} owned)")
                return
            if worker.ae.open_streams():
                self.violation(f"{worker.name}: {worker.ae.open_streams()} request streams left at rest")
                return
            control = role.control
            if worker.kind == "prefill":
                sizes = control.sizes()
                registered = control.sessions()
                stale = [p for p in registered if p.incarnation not in live_decodes]
                if sizes["ended"] or sizes["unregistered"] or stale:
                    self.violation(f"{worker.name}: per-peer tables not bounded at rest: {sizes}, sessions of dead "
                                   f"decodes {stale}")
                    return
                agents = role.transfer.peers()
                if any(p not in registered for p in agents):
                    self.violation(f"{worker.name}: transfer connections to ended sessions at rest: "
                                   f"{sorted(str(p) for p in agents if p not in registered)}")
                    return
            else:
                sessions = control.sizes()["sessions"]
                if sessions > cluster.config.prefills:
                    self.violation(f"{worker.name}: {sessions} control sessions at rest for "
                                   f"{cluster.config.prefills} prefill addresses")
                    return
                links = len(role.links.writers())
                if links > cluster.config.prefills:
                    self.violation(f"{worker.name}: {links} receiving links open at rest")
                    return


def _describe_records(role, n: int = 3) -> str:
    """The first ``n`` records, as what they hold (for a violation's message)."""
    rows = []
    for room, rec in list(role.rooms.items())[:n]:
        r = role.table.rooms().get(room)
        rows.append(f"room {room} ({rec.req.rid}: {'answered' if rec.answered else 'unanswered'}, "
                    f"{len(rec.pages)} pages, seq {'none' if rec.seq is None else len(rec.seq.pages)} pages, "
                    f"want {rec.want_pages}, {'quarantined, ' if rec.quarantined else ''}"
                    f"table {'gone' if r is None else r.state})")
    return "[" + "; ".join(rows) + (" ..." if len(role.rooms) > n else "") + "]"


def _page_owners(role) -> dict[int, tuple]:
    """page -> (room, record, the page's index in the room's sequence of pages, or None when its
    position is not known: a quarantined record keeps only its write targets)."""
    owners = {}
    for room, rec in role.rooms.items():
        for i, page in enumerate(rec.pages):
            owners[page] = (room, rec, None if rec.quarantined else i)
        if rec.seq is not None:
            for i, page in enumerate(rec.seq.pages):
                owners[page] = (room, rec, i)
    return owners


def _pages_of(flight, page_nbytes: int) -> list[int]:
    pages = []
    for span in flight.handle.spans:
        first = span.remote_offset // page_nbytes
        pages.extend(range(first, first + span.nbytes // page_nbytes))
    return pages


class Trace:
    """The last events of a run, formatted only when a failing run prints them."""

    def __init__(self, loop, size: int = 80):
        self.loop = loop
        self.events: deque = deque(maxlen=size)

    def __call__(self, what, *args) -> None:
        self.events.append((self.loop.time(), what, args))

    def lines(self) -> list[str]:
        out = []
        for t, what, args in self.events:
            text = what(*args) if callable(what) else (what % args if args else what)
            out.append(f"  t={t:10.4f} {text}")
        return out

