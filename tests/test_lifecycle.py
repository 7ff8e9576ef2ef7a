"""Unit tests of the request lifecycle (docs/design.md §2), one rule at a time, with a fake clock.

Each test is named for the rule it proves (``test_rule<N>_...``); ``docs/lifecycle.md`` lists
them by rule. Every order of events at once is the business of ``test_lifecycle_interleavings.py``.
"""

from __future__ import annotations

import dataclasses

import ast
import pathlib

import pytest

from splitserve.disagg import protocol
from splitserve.disagg.lifecycle import (
    Admitted, Cancel, CancelWrites, ChunkDone, ClientAbort, CountOutcome, DeadlineHeap, Deadlines, DecodeState,
    DecodeStep, DecodeTable, DisconnectPeer, Ending, Enqueue, Finished, ForwardDone, FreePages, FromPeer,
    IllegalMove, LocalFailure, LogTerminal, Moved, Notice, NoticeKind, NotifyClient, Outcome,
    PagesReserved, Peer, PeerHeard, PeerInfo, PeerLost, PeerTable, PrefillState, PrefillTable,
    QuarantinePages, Reason, ReleaseQuarantine, RequestArrived, ReservePages, ResetTransfer, Role,
    Scheduled, SendToPeer, StartDecode, StartWrite, WriteDone, WriteFailed, is_terminal,
)

PP = Peer("prefill-0:7000", "p1")
DP = Peer("decode-0:7100", "d1")
D = Deadlines()
ROOM, RID, PROMPT = 7, "r7", 8  # 8 tokens, page size 4: 2 pages
DST, SRC = (10, 11), (100, 101)


# -- helpers ---------------------------------------------------------------------------------------


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def sent(actions, cls=None, to=None):
    return [a.msg for a in actions if isinstance(a, SendToPeer)
            and (cls is None or isinstance(a.msg, cls)) and (to is None or a.peer == to)]


def notices(actions, kind):
    return [a for a in actions if isinstance(a, Notice) and a.kind is kind]


def freed(actions):
    return [p for a in actions if isinstance(a, (FreePages, ReleaseQuarantine)) for p in a.pages]


def assert_one_ending(actions, reason, room=ROOM):
    """Rule 7: exactly one answer, one log line, one count, all for the same ending."""
    answers, logs, counts = of(actions, NotifyClient), of(actions, LogTerminal), of(actions, CountOutcome)
    assert len(answers) == len(logs) == len(counts) == 1, actions
    assert answers[0].room == logs[0].room == room
    assert answers[0].ending.reason is logs[0].ending.reason is counts[0].reason is reason
    assert counts[0].outcome is answers[0].ending.outcome


def assert_no_ending(actions):
    assert not of(actions, NotifyClient) and not of(actions, LogTerminal) and not of(actions, CountOutcome), actions


def register(room=ROOM, pages=DST, prompt_len=PROMPT, prefill_incarnation="p1"):
    return protocol.RegisterRoom(room, DP.incarnation, prefill_incarnation, f"r{room}", prompt_len, list(pages), 0)


def new_prefill(deadlines=D):
    return PrefillTable(deadlines, PP.incarnation, page_size=4, page_nbytes=1 << 20)


def new_decode(deadlines=D):
    return DecodeTable(deadlines, DP.incarnation, page_size=4)


def tick(table, now):
    """One engine-loop iteration at ``now``: the inbox (a heartbeat from the peer) is drained
    first, then deadlines are checked. A test that jumps the clock keeps the peer alive this way."""
    peer = DP if isinstance(table, PrefillTable) else PP
    return table.handle(PeerHeard(peer), now) + table.expire(now)


PREFILL_PATH = [  # event, state after it
    (lambda: RequestArrived(ROOM, RID, PROMPT), PrefillState.BOOTSTRAPPING),
    (lambda: FromPeer(DP, register()), PrefillState.QUEUED),
    (lambda: Scheduled(ROOM, SRC), PrefillState.PREFILLING),
    (lambda: ChunkDone(ROOM, 1), PrefillState.PREFILLING),  # write 1: page 0
    (lambda: ForwardDone(ROOM, 42), PrefillState.TRANSFERRING),  # write 2: page 1
]
PREFILL_STEPS = {PrefillState.BOOTSTRAPPING: 1, PrefillState.QUEUED: 2, PrefillState.PREFILLING: 4,
                 PrefillState.TRANSFERRING: 5}


def prefill_in(state, deadlines=D, now=0.0):
    """A prefill table holding room 7 in ``state`` (PREFILLING: its first chunk's write in flight)."""
    table = new_prefill(deadlines)
    for event, _ in PREFILL_PATH[: PREFILL_STEPS[state]]:
        table.handle(event(), now)
    assert table.state_of(ROOM) is state
    return table


DECODE_PATH = [
    lambda: RequestArrived(ROOM, RID, PROMPT),
    lambda: PagesReserved(ROOM, DST),
    lambda: PeerInfo(ROOM, PP),
    lambda: FromPeer(PP, protocol.KVDone(ROOM, PP.incarnation, 42, PROMPT)),
    lambda: Admitted(ROOM),  # the scheduler took its sequence: the stall bound runs from here
]
DECODE_STEPS = {DecodeState.PREALLOC: 2, DecodeState.AWAITING_KV: 3, DecodeState.DECODING: 5}


def decode_in(state, deadlines=D, now=0.0, with_pages=True):
    """A decode table holding room 7 in ``state`` (PREALLOC: with its pages unless told otherwise)."""
    table = new_decode(deadlines)
    steps = DECODE_STEPS[state] - (0 if with_pages else 1)
    for event in DECODE_PATH[:steps]:
        table.handle(event(), now)
    assert table.state_of(ROOM) is state
    return table


# == rule 1: one owner; pure logic ==================================================================

LIFECYCLE_DIR = pathlib.Path(__file__).resolve().parent.parent / "splitserve" / "disagg" / "lifecycle"


def test_rule1_lifecycle_reads_no_clock_starts_no_thread_and_does_no_io():
    """The state machines are only ever driven: no clock, threads, locks, sockets, files or logs
    inside, so the engine loop is their one owner and tests can drive any order of events."""
    forbidden_modules = {"time", "threading", "asyncio", "socket", "logging", "datetime", "os", "zmq",
                         "multiprocessing", "concurrent", "random", "queue", "selectors"}
    forbidden_calls = {"open", "print", "input", "sleep"}
    files = sorted(LIFECYCLE_DIR.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.name} has no module docstring"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & forbidden_modules, f"{path.name} imports {names & forbidden_modules}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in forbidden_calls, f"{path.name} calls {node.func.id}()"
        assert len(path.read_text().splitlines()) < 400, f"{path.name} is too long to read in one sitting"


CHECKED_DIRS = [LIFECYCLE_DIR, LIFECYCLE_DIR.parent / "transfer"]


def test_rule1_invariants_are_checks_that_raise_never_asserts():
    """``python -O`` strips ``assert``: the lifecycle's and the transfer's invariants raise instead
    (``LifecycleError``, ``TypeError``...), as the page allocator's do; run under -O, they still do."""
    files = [p for d in CHECKED_DIRS for p in sorted(d.glob("*.py"))]
    for path in files:
        asserts = [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Assert)]
        assert not asserts, f"{path.name}: assert at lines {asserts} (python -O strips it): raise instead"
    script = (
        "from splitserve.disagg.lifecycle import *\n"
        "t = PrefillTable(Deadlines(), 'p1', 4)\n"
        "t.handle(RequestArrived(7, 'r7', 8), 0)\n"
        "for bad in (lambda: t._release(t._rooms[7], 1, []), lambda: t._enter(t._rooms[7], PrefillState.TRANSFERRING, 1, []),\n"
        "            lambda: t.peers.bind(Peer('d', 'x'), 7, 1) if t.peers.declare_lost(Peer('d', 'x'), 1) or True else 0):\n"
        "    try:\n"
        "        bad()\n"
        "    except LifecycleError as e:\n"
        "        print('raised', type(e).__name__)\n"
    )
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["raised LifecycleError", "raised IllegalMove", "raised LifecycleError"], done


def test_rule1_tables_share_no_state():
    a, b = new_prefill(), new_prefill()
    a.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    assert a.state_of(ROOM) is PrefillState.BOOTSTRAPPING and b.state_of(ROOM) is None
    assert b.is_idle()


# == rule 2: terminal is absorbing =================================================================


def test_rule2_states_have_no_order_so_max_cannot_resurrect_a_request():
    with pytest.raises(TypeError):
        max(PrefillState.TRANSFERRING, Outcome.FAILED)
    with pytest.raises(TypeError):
        _ = DecodeState.DECODING < Outcome.ABORTED
    assert all(is_terminal(o) for o in Outcome)
    assert not any(is_terminal(s) for s in (*PrefillState, *DecodeState))


def every_prefill_event(now=0.0):
    return [
        RequestArrived(ROOM, RID, PROMPT), FromPeer(DP, register()), Scheduled(ROOM, (200, 201)),
        ChunkDone(ROOM, 2), ForwardDone(ROOM, 1), WriteDone(ROOM, 1), WriteFailed(ROOM, 2, "x"),
        ClientAbort(ROOM), LocalFailure(ROOM, Reason.INTERNAL_ERROR),
        FromPeer(DP, protocol.AbortRoom(ROOM, DP.incarnation, "client_abort")), PeerHeard(DP),
    ]


def every_decode_event():
    return [
        RequestArrived(ROOM, RID, PROMPT), PagesReserved(ROOM, (30, 31)), PeerInfo(ROOM, PP),
        FromPeer(PP, protocol.KVDone(ROOM, PP.incarnation, 42, PROMPT)),
        FromPeer(PP, protocol.RoomFailed(ROOM, PP.incarnation, "stalled")),
        FromPeer(PP, protocol.WritesSettled(ROOM, PP.incarnation)), DecodeStep(ROOM, (40,)),
        Finished(ROOM, Reason.STOP), ClientAbort(ROOM), LocalFailure(ROOM, Reason.INTERNAL_ERROR), PeerHeard(PP),
    ]


def test_rule2_terminal_is_absorbing_on_prefill():
    table = prefill_in(PrefillState.QUEUED)
    table.handle(ClientAbort(ROOM), 1)
    for event in every_prefill_event():
        actions = table.handle(event, 2)
        if isinstance(event, RequestArrived):  # a second request for the room: refused, on its own
            assert_one_ending(actions, Reason.BAD_REQUEST)
        else:
            assert_no_ending(actions)
        assert table.state_of(ROOM) is Outcome.ABORTED
        assert table.ending_of(ROOM).reason is Reason.CLIENT_ABORT


def test_rule2_terminal_is_absorbing_on_decode():
    table = decode_in(DecodeState.DECODING)
    table.handle(Finished(ROOM, Reason.LENGTH), 1)
    for event in every_decode_event():
        actions = table.handle(event, 2)
        if isinstance(event, RequestArrived):
            assert_one_ending(actions, Reason.BAD_REQUEST)
        else:
            assert_no_ending(actions)
        assert table.state_of(ROOM) is Outcome.FINISHED
    assert table.expire(D.tombstone_s - 1) == []


DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"


def _doc_section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n#", start + len(heading))
    return text[start: end if end != -1 else len(text)]


def _doc_rows(block: str) -> list[list[str]]:
    """The body rows of the first markdown table in ``block``, each as its cells."""
    lines = block.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[start + 2: end]]


def _doc_states(cell: str) -> list[str]:
    return [w.strip().strip("`") for w in cell.split(",")]


def test_rule2_the_docs_moves_and_deadlines_are_the_declared_ones():
    """docs/lifecycle.md's move tables list exactly the moves of each role's transitions, and its
    state tables the deadline each state is declared with."""
    text = DOCS.read_text()
    moves = _doc_section(text, "### Moves")
    states = _doc_section(text, "## States")
    for table, label in ((PrefillTable, "Prefill:"), (DecodeTable, "Decode:")):
        t = table.transitions
        named = {s.value: s for s in [*t.live_states(), *Outcome]}
        documented = set()
        for before, after, _ in _doc_rows(moves[moves.index(label):]):
            sources = [None] if before == "(arrival)" else t.live_states() if before == "every live state" \
                else [named[b] for b in _doc_states(before)]
            documented |= {(b, named[a]) for b in sources for a in _doc_states(after)}
        assert documented == set(t.pairs()), f"{t.role.value}: the docs and transitions.py differ"
        rows = {r[0].strip("`"): r for r in _doc_rows(states[states.index(label.rstrip(":") + ", one room:"):])}
        for state, live in t.states.items():
            deadline = rows[state.value][2].split("`")[1].split("(")[0]
            assert deadline == live.deadline, f"{state.value}: the docs say {deadline}, the code {live.deadline}"


def test_rule2_an_undeclared_move_raises_before_anything_moves():
    table = decode_in(DecodeState.DECODING)
    r, out = table._rooms[ROOM], []
    with pytest.raises(IllegalMove, match="DECODING -> PREALLOC"):
        table._enter(r, DecodeState.PREALLOC, 1.0, out)
    assert table.state_of(ROOM) is DecodeState.DECODING and out == []
    assert not isinstance(IllegalMove("x"), AssertionError)  # python -O keeps it
    with pytest.raises(IllegalMove):
        PrefillTable.transitions.check(ROOM, PrefillState.QUEUED, Outcome.FINISHED)
    table.handle(Finished(ROOM, Reason.LENGTH), 2)
    with pytest.raises(IllegalMove, match="FINISHED -> FAILED"):  # nothing leaves a terminal state
        table._end(r, Ending(Reason.STALLED), 3.0, out)


def test_rule2_prefill_finishes_from_prefilling_when_every_write_landed_before_the_forward_pass_ended():
    table = prefill_in(PrefillState.PREFILLING)  # write 1 (page 0) in flight
    assert of(table.handle(ChunkDone(ROOM, 2), 1), StartWrite)  # write 2: page 1, the last
    table.handle(WriteDone(ROOM, 1), 2)
    table.handle(WriteDone(ROOM, 2), 2)
    actions = table.handle(ForwardDone(ROOM, 42), 3)
    [moved] = of(actions, Moved)
    assert (moved.before, moved.after, moved.cause) == (PrefillState.PREFILLING, Outcome.FINISHED, "ForwardDone")
    assert sent(actions, protocol.KVDone, to=DP) and table.ending_of(ROOM).reason is Reason.TRANSFERRED


def test_rule2_every_move_is_emitted_in_order_with_its_cause_and_time():
    table, moves = new_prefill(), []
    for i, (event, _) in enumerate(PREFILL_PATH):
        moves += of(table.handle(event(), float(i)), Moved)
    moves += of(table.handle(WriteDone(ROOM, 1), 5.0) + table.handle(WriteDone(ROOM, 2), 7.0), Moved)
    assert [(m.before, m.after, m.cause, m.seconds) for m in moves] == [
        (None, PrefillState.BOOTSTRAPPING, "RequestArrived", 0.0),
        (PrefillState.BOOTSTRAPPING, PrefillState.QUEUED, f"RegisterRoom from {DP}", 1.0),
        (PrefillState.QUEUED, PrefillState.PREFILLING, "Scheduled", 1.0),
        (PrefillState.PREFILLING, PrefillState.TRANSFERRING, "ForwardDone", 2.0),
        (PrefillState.TRANSFERRING, Outcome.FINISHED, "WriteDone", 3.0),
    ]
    assert moves[-1].ending == Ending(Reason.TRANSFERRED)
    assert [m.after for m in of(prefill_in(PrefillState.QUEUED).expire(D.queue_s), Moved)] == [Outcome.FAILED]


# == rule 3: every non-terminal state has a deadline ===============================================

PREFILL_TIMEOUTS = [
    (PrefillState.BOOTSTRAPPING, D.bootstrap_s, Reason.BOOTSTRAP_TIMEOUT),
    (PrefillState.QUEUED, D.queue_s, Reason.OVERLOADED),
    (PrefillState.PREFILLING, D.prefill_stall_s, Reason.STALLED),
    (PrefillState.TRANSFERRING, D.transfer_s(2 << 20), Reason.TRANSFER_TIMEOUT),  # two 1 MiB pages in flight
]


@pytest.mark.parametrize("state,limit,reason", PREFILL_TIMEOUTS, ids=[s.name for s, *_ in PREFILL_TIMEOUTS])
def test_rule3_every_prefill_state_has_a_deadline(state, limit, reason):
    table = prefill_in(state)
    [row] = table.snapshot(0)
    assert row["state"] == state.value and row["deadline_s"] == pytest.approx(limit)
    assert tick(table, limit - 0.001) == []  # not a moment early
    actions = tick(table, limit)
    assert_one_ending(actions, reason)
    assert table.state_of(ROOM) is Outcome.FAILED


DECODE_TIMEOUTS = [
    ("PREALLOC, no pages", DecodeState.PREALLOC, False, D.prealloc_s, Reason.BOOTSTRAP_TIMEOUT),
    ("PREALLOC, no info", DecodeState.PREALLOC, True, D.prealloc_s, Reason.BOOTSTRAP_TIMEOUT),
    ("AWAITING_KV", DecodeState.AWAITING_KV, True, D.kv_wait_s, Reason.TRANSFER_TIMEOUT),
    ("DECODING", DecodeState.DECODING, True, D.decode_stall_s, Reason.STALLED),
]


@pytest.mark.parametrize("name,state,with_pages,limit,reason", DECODE_TIMEOUTS, ids=[t[0] for t in DECODE_TIMEOUTS])
def test_rule3_every_decode_state_has_a_deadline(name, state, with_pages, limit, reason):
    table = decode_in(state, with_pages=with_pages)
    [row] = table.snapshot(0)
    assert row["deadline_s"] == pytest.approx(limit)
    assert [a for a in tick(table, limit - 0.001) if not sent([a], protocol.RegisterRoom)] == []  # resends aside
    assert_one_ending(tick(table, limit), reason)


def test_rule3_a_registration_is_resent_until_the_kv_comes_so_a_lost_one_costs_a_delay():
    table = decode_in(DecodeState.AWAITING_KV)
    every = D.register_resend_s
    for k in (1, 2):
        assert sent(tick(table, k * every), protocol.RegisterRoom, to=PP) == [register()]
    assert not sent(tick(table, 2.5 * every), protocol.RegisterRoom)
    table.handle(FromPeer(PP, protocol.KVDone(ROOM, PP.incarnation, 42, PROMPT)), 2.5 * every)
    assert not sent(tick(table, 3 * every) + tick(table, 4 * every), protocol.RegisterRoom)
    ended = decode_in(DecodeState.AWAITING_KV)
    ended.handle(LocalFailure(ROOM, Reason.INTERNAL_ERROR, "boom"), 1)
    assert not sent(ended.expire(every) + ended.expire(2 * every), protocol.RegisterRoom)


def test_rule3_decode_waiting_for_pages_with_info_in_hand_is_overloaded():
    table = new_decode()
    table.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    table.handle(PeerInfo(ROOM, PP), 0)
    actions = tick(table, D.prealloc_s)
    assert_one_ending(actions, Reason.OVERLOADED)
    assert "no KV pages" in of(actions, NotifyClient)[0].ending.detail
    assert sent(actions, protocol.AbortRoom, to=PP)  # prefill learns it too (rule 5)


def test_rule3_progress_pushes_the_stall_deadline_back():
    table = prefill_in(PrefillState.PREFILLING)  # stall deadline at 30
    table.handle(ChunkDone(ROOM, 1), 20)  # a chunk finished at 20: the next is due by 50
    assert tick(table, 45) == []
    assert_one_ending(tick(table, 50), Reason.STALLED)
    dec = decode_in(DecodeState.DECODING)
    dec.handle(DecodeStep(ROOM), 25)
    assert dec.expire(54) == []
    assert_one_ending(dec.expire(55), Reason.STALLED)


def test_rule3_transfer_deadline_is_a_floor_plus_a_part_per_byte():
    assert D.transfer_s(0) == D.transfer_floor_s
    assert D.transfer_s(2 << 30) == pytest.approx(D.transfer_floor_s + 2 * D.transfer_s_per_gib)
    big = PrefillTable(D, PP.incarnation, page_size=4, page_nbytes=1 << 30)  # 1 GiB pages
    for event, _ in PREFILL_PATH[:3]:
        big.handle(event(), 0)
    big.handle(ForwardDone(ROOM, 42), 0)  # both pages in flight: 2 GiB
    [row] = big.snapshot(0)
    assert row["deadline_s"] == pytest.approx(D.transfer_floor_s + 2 * D.transfer_s_per_gib)


def test_rule3_request_timeout_caps_every_state():
    d = Deadlines(request_timeout_s=20.0)
    table = prefill_in(PrefillState.QUEUED, deadlines=d)  # queue_s is 60: the request limit comes first
    assert table.snapshot(0)[0]["deadline_s"] == pytest.approx(20)
    assert_one_ending(tick(table, 20), Reason.REQUEST_TIMEOUT)
    dec = decode_in(DecodeState.AWAITING_KV, deadlines=d)
    assert_one_ending(tick(dec, 20), Reason.REQUEST_TIMEOUT)


def test_rule3_deadline_heap_replaces_cancels_and_pops_in_order():
    heap: DeadlineHeap[str] = DeadlineHeap()
    heap.set("a", 5)
    heap.set("b", 3)
    heap.set("a", 1)  # replaces a@5; the old entry is skipped, not searched for
    heap.set("c", 4)
    heap.cancel("c")
    assert heap.next_due() == 1 and len(heap) == 2 and "c" not in heap
    assert heap.pop_due(2) == ["a"]
    assert heap.pop_due(10) == ["b"]
    assert heap.next_due() is None and heap.pop_next(100) is None


def test_rule3_deadline_heap_stays_small_under_churn():
    """Lazy deletion leaves stale entries; they are compacted away, so memory stays O(live keys)."""
    heap: DeadlineHeap[int] = DeadlineHeap()
    for i in range(100_000):
        heap.set(i % 10, float(i))  # ten keys, refreshed over and over (like heartbeats)
    assert len(heap) == 10 and len(heap._heap) <= 2 * 10 + 64 + 1
    assert heap.pop_due(1e9) == [k for k in range(10)]


def test_rule3_expire_pops_only_what_is_due():
    """expire() costs O(log n) per due deadline: 10,000 live rooms, none due, none touched."""
    table = new_prefill()
    for room in range(10_000):
        table.handle(RequestArrived(room, f"r{room}", PROMPT), float(room) / 1000)
    assert table.next_due() == pytest.approx(D.bootstrap_s)
    assert table.expire(D.bootstrap_s - 0.01) == []
    actions = table.expire(D.bootstrap_s + 0.0005)  # room 0 arrived at 0 s, room 1 at 0.001 s
    assert len(of(actions, LogTerminal)) == 1


def test_rule3_validate_requires_the_tombstone_to_outlive_every_deadline():
    assert D.validate() is D
    with pytest.raises(ValueError, match="tombstone_s"):
        Deadlines(kv_wait_s=1000.0).validate()
    with pytest.raises(ValueError, match="tombstone_s"):
        Deadlines(request_timeout_s=900.0).validate()
    with pytest.raises(ValueError, match="transfer_s"):
        D.validate(max_transfer_bytes=1000 << 30)  # 1000 GiB at 4 s/GiB
    with pytest.raises(ValueError, match="positive"):
        Deadlines(queue_s=0).validate()
    with pytest.raises(ValueError, match="heartbeat_misses"):
        Deadlines(heartbeat_misses=0).validate()
    with pytest.raises(ValueError):
        new_prefill(Deadlines(tombstone_s=10))  # a table refuses invalid deadlines


def test_rule3_pending_registration_has_a_deadline_and_decode_is_told():
    table = new_prefill()
    assert table.handle(FromPeer(DP, register()), 0) == []
    assert table.counts_by_state()["pending_registrations"] == 1
    actions = tick(table, D.pending_registration_s)
    assert notices(actions, NoticeKind.PENDING_EXPIRED)
    assert [type(m) for m in sent(actions, to=DP)] == [protocol.RoomFailed, protocol.WritesSettled]
    assert sent(actions)[0].reason == "bootstrap_timeout"
    # The request, if it ever comes, is refused: decode gave up on it.
    assert_one_ending(table.handle(RequestArrived(ROOM, RID, PROMPT), 70), Reason.BOOTSTRAP_TIMEOUT)


def test_rule3_registration_before_request_is_held_and_used():
    table = new_prefill()
    table.handle(FromPeer(DP, register()), 0)
    actions = table.handle(RequestArrived(ROOM, RID, PROMPT), 5)
    assert table.state_of(ROOM) is PrefillState.QUEUED and of(actions, Enqueue)
    assert table.counts_by_state()["pending_registrations"] == 0
    assert tick(table, D.pending_registration_s + 1) == []  # its deadline went with it


# == rule 4: abort works in every state and every order ============================================

PREFILL_STATES = [PrefillState.BOOTSTRAPPING, PrefillState.QUEUED, PrefillState.PREFILLING, PrefillState.TRANSFERRING]


@pytest.mark.parametrize("state", PREFILL_STATES, ids=lambda s: s.name)
def test_rule4_client_abort_works_in_every_prefill_state(state):
    table = prefill_in(state)
    actions = table.handle(ClientAbort(ROOM, "client went away"), 1)
    assert_one_ending(actions, Reason.CLIENT_ABORT)
    assert table.state_of(ROOM) is Outcome.ABORTED and of(actions, Cancel)
    if state is not PrefillState.BOOTSTRAPPING:  # decode is known: it is told (rule 5)
        assert sent(actions, protocol.RoomFailed, to=DP)[0].reason == "client_abort"


DECODE_STATES = [DecodeState.PREALLOC, DecodeState.AWAITING_KV, DecodeState.DECODING]


@pytest.mark.parametrize("state", DECODE_STATES, ids=lambda s: s.name)
def test_rule4_client_abort_works_in_every_decode_state(state):
    table = decode_in(state)
    actions = table.handle(ClientAbort(ROOM), 1)
    assert_one_ending(actions, Reason.CLIENT_ABORT)
    assert table.state_of(ROOM) is Outcome.ABORTED
    if state is DecodeState.AWAITING_KV:
        assert sent(actions, protocol.AbortRoom, to=PP)[0].reason == "client_abort"


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_rule4_abort_before_the_request_leaves_a_tombstone_that_refuses_it(side):
    table = new_prefill() if side == "prefill" else new_decode()
    actions = table.handle(ClientAbort(ROOM), 0)
    assert notices(actions, NoticeKind.TOMBSTONE) and table.counts_by_state()["tombstones"] == 1
    actions = table.handle(RequestArrived(ROOM, RID, PROMPT), 3)
    assert_one_ending(actions, Reason.CLIENT_ABORT)
    assert of(actions, LogTerminal)[0].last_state is None  # refused on arrival, never a room
    assert table.live_rooms() == []


def test_rule4_tombstone_expires_after_its_lifetime():
    table = new_prefill()
    table.handle(ClientAbort(ROOM), 0)
    table.expire(D.tombstone_s)
    assert table.is_idle()
    table.handle(RequestArrived(ROOM, RID, PROMPT), D.tombstone_s + 1)  # a new request may reuse the id
    assert table.state_of(ROOM) is PrefillState.BOOTSTRAPPING


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_rule4_abort_after_release_is_a_logged_no_op(side):
    table = prefill_in(PrefillState.QUEUED) if side == "prefill" else decode_in(DecodeState.PREALLOC)
    table.handle(LocalFailure(ROOM, Reason.BAD_REQUEST, "bad"), 1)
    actions = table.handle(ClientAbort(ROOM), 2)
    assert_no_ending(actions)
    assert notices(actions, NoticeKind.ABORT_AFTER_END)
    assert table.ending_of(ROOM).reason is Reason.BAD_REQUEST


def test_rule4_abort_before_the_request_with_registration_pending_tells_decode():
    table = new_prefill()
    table.handle(FromPeer(DP, register()), 0)
    actions = table.handle(ClientAbort(ROOM), 1)
    assert [type(m) for m in sent(actions, to=DP)] == [protocol.RoomFailed, protocol.WritesSettled]
    assert table.counts_by_state()["pending_registrations"] == 0
    assert_one_ending(table.handle(RequestArrived(ROOM, RID, PROMPT), 2), Reason.CLIENT_ABORT)


def test_rule4_decode_abort_before_prefill_saw_the_request_refuses_it_there():
    table = new_prefill()
    actions = table.handle(FromPeer(DP, protocol.AbortRoom(ROOM, DP.incarnation, "client_abort")), 0)
    assert sent(actions, protocol.WritesSettled, to=DP)  # nothing can be in flight for it
    actions = table.handle(RequestArrived(ROOM, RID, PROMPT), 1)
    assert_one_ending(actions, Reason.PEER_ABORT)


# == rule 5: both sides learn of every failure =====================================================


def test_rule5_a_prefill_failure_is_sent_to_decode_and_decode_fails_the_room():
    pre, dec = prefill_in(PrefillState.QUEUED), decode_in(DecodeState.AWAITING_KV)
    actions = tick(pre, D.queue_s)
    assert_one_ending(actions, Reason.OVERLOADED)
    msgs = sent(actions, to=DP)
    assert [type(m) for m in msgs] == [protocol.RoomFailed, protocol.WritesSettled]
    out = dec.handle(FromPeer(PP, msgs[0]), D.queue_s)
    assert_one_ending(out, Reason.PEER_FAILED)
    assert "overloaded" in of(out, NotifyClient)[0].ending.detail
    assert not sent(out)  # no echo back to the peer that told us


def test_rule5_a_decode_failure_is_sent_to_prefill_and_prefill_ends_the_room():
    pre, dec = prefill_in(PrefillState.PREFILLING), decode_in(DecodeState.AWAITING_KV)
    actions = dec.handle(LocalFailure(ROOM, Reason.INTERNAL_ERROR, "cuda error"), 3)
    [msg] = sent(actions, protocol.AbortRoom, to=PP)
    out = pre.handle(FromPeer(DP, msg), 3)
    assert_one_ending(out, Reason.PEER_FAILED)
    assert not sent(out, protocol.RoomFailed)  # no echo
    client = decode_in(DecodeState.AWAITING_KV).handle(ClientAbort(ROOM), 3)
    out = prefill_in(PrefillState.QUEUED).handle(FromPeer(DP, sent(client)[0]), 3)
    assert_one_ending(out, Reason.PEER_ABORT)
    assert of(out, NotifyClient)[0].ending.outcome is Outcome.ABORTED


def test_rule5_decode_learns_a_failure_that_happened_before_it_registered():
    """Prefill timed out in BOOTSTRAPPING (decode unknown then): the late registration is answered."""
    table = new_prefill()
    table.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    table.expire(D.bootstrap_s)
    actions = table.handle(FromPeer(DP, register()), D.bootstrap_s + 1)
    assert [type(m) for m in sent(actions, to=DP)] == [protocol.RoomFailed, protocol.WritesSettled]
    assert sent(actions)[0].reason == "bootstrap_timeout"


def test_rule5_a_late_registration_for_a_finished_room_gets_its_kv_done_again():
    """Decode re-sends its registration while it waits for the KV: if the KVDone was lost, the
    re-sent registration gets it again (every write had landed before the first one was sent).
    The same registration from another peer is only noted."""
    table = prefill_in(PrefillState.TRANSFERRING)
    first = table.handle(WriteDone(ROOM, 1), 1) + table.handle(WriteDone(ROOM, 2), 1)
    assert table.state_of(ROOM) is Outcome.FINISHED
    [kv_done] = sent(first, protocol.KVDone, to=DP)
    actions = table.handle(FromPeer(DP, register()), 2)
    assert notices(actions, NoticeKind.LATE_MESSAGE) and sent(actions) == [kv_done]
    other = Peer("decode-b:1", "d9", 1)
    actions = table.handle(FromPeer(other, dataclasses.replace(register(), incarnation="d9")), 3)
    assert notices(actions, NoticeKind.LATE_MESSAGE) and not sent(actions)


def test_rule5_a_silent_peer_fails_all_its_rooms_within_bounded_time():
    table = new_prefill()
    for room in (1, 2, 3):
        table.handle(RequestArrived(room, f"r{room}", PROMPT), 0)
        table.handle(FromPeer(DP, register(room=room)), 0)
    silence = D.peer_silence_s
    table.handle(PeerHeard(DP), 2.0)  # heartbeats keep it alive...
    assert table.expire(2.0 + silence - 0.01) == []
    actions = table.expire(2.0 + silence)  # ...until they stop
    assert of(actions, DisconnectPeer)[0].peer == DP
    assert len(of(actions, LogTerminal)) == 3
    assert {a.ending.reason for a in of(actions, NotifyClient)} == {Reason.PEER_LOST}
    assert not sent(actions)  # nothing is sent to a lost peer
    assert table.peers.is_lost(DP)


def test_rule5_a_long_forward_pass_does_not_make_a_live_peer_look_dead():
    """Heartbeats answered off the loop wait in the inbox; draining it before expire() keeps the peer."""
    table = prefill_in(PrefillState.PREFILLING)
    inbox = [PeerHeard(DP)]  # posted at t=4.9 while the loop was busy until t=8
    for event in inbox:
        table.handle(event, 8.0)
    assert not of(table.expire(8.0), DisconnectPeer)


def test_rule5_a_new_incarnation_declares_the_old_one_lost_at_once():
    table = decode_in(DecodeState.AWAITING_KV)
    restarted = Peer(PP.name, "p2")
    actions = table.handle(PeerHeard(restarted, fresh=True), 1)
    assert of(actions, DisconnectPeer)[0].peer == PP
    assert_one_ending(actions, Reason.PEER_LOST)
    assert freed(actions) == list(DST)  # the old incarnation's writes are fenced: no quarantine


def test_rule5_a_stale_message_from_a_dead_incarnation_never_kills_the_live_one():
    table = decode_in(DecodeState.AWAITING_KV)
    old = Peer(PP.name, "p0")
    actions = table.handle(FromPeer(old, protocol.WritesSettled(ROOM, old.incarnation)), 1)
    assert not of(actions, DisconnectPeer)
    assert notices(actions, NoticeKind.WRONG_PEER)
    assert table.state_of(ROOM) is DecodeState.AWAITING_KV


def test_rule5_a_message_for_a_room_from_another_peer_is_rejected_and_counted():
    table = prefill_in(PrefillState.QUEUED)
    other = Peer("decode-1:7100", "d9")
    actions = table.handle(FromPeer(other, protocol.AbortRoom(ROOM, other.incarnation, "client_abort")), 1)
    assert notices(actions, NoticeKind.WRONG_PEER) and table.state_of(ROOM) is PrefillState.QUEUED
    dec = decode_in(DecodeState.AWAITING_KV)
    actions = dec.handle(FromPeer(Peer("prefill-1:7000", "p9"), protocol.KVDone(ROOM, "p9", 1, PROMPT)), 1)
    assert notices(actions, NoticeKind.WRONG_PEER) and dec.state_of(ROOM) is DecodeState.AWAITING_KV


def test_rule5_a_duplicate_registration_is_rejected():
    table = prefill_in(PrefillState.QUEUED)
    actions = table.handle(FromPeer(DP, register()), 1)  # the same decode, again
    assert notices(actions, NoticeKind.DUPLICATE_REGISTRATION) and not sent(actions)
    other = Peer("decode-1:7100", "d9")
    actions = table.handle(FromPeer(other, register()), 1)  # another decode claims the room
    assert notices(actions, NoticeKind.WRONG_PEER)
    assert [type(m) for m in sent(actions, to=other)] == [protocol.RoomFailed, protocol.WritesSettled]
    assert table.state_of(ROOM) is PrefillState.QUEUED


def test_rule5_a_lost_peer_is_never_recomputed_against():
    table = new_prefill()
    table.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    table.handle(FromPeer(DP, register()), 0)
    table.handle(PeerLost(DP, "connection reset"), 1)
    table.handle(RequestArrived(8, "r8", PROMPT), 2)
    actions = table.handle(FromPeer(DP, register(room=8)), 2)  # the lost peer is back
    assert notices(actions, NoticeKind.FROM_LOST_PEER)
    assert sent(actions, protocol.RoomFailed, to=DP)[0].reason == "peer_lost"
    assert not sent(actions, protocol.WritesSettled)  # a lost peer is never vouched to: only its fence is safe
    assert table.state_of(8) is PrefillState.BOOTSTRAPPING  # not registered


def test_rule5_a_prefill_that_lost_us_ends_the_session_and_the_next_one_serves():
    """An asymmetric partition healed: prefill declared our session lost and refuses its rooms with
    peer_lost. Decode ends that session (the fence first) and a room on the next session registers."""
    dec = decode_in(DecodeState.AWAITING_KV)
    actions = dec.handle(FromPeer(PP, protocol.RoomFailed(ROOM, "p1", "peer_lost")), 1)
    assert_one_ending(actions, Reason.PEER_FAILED)  # the peer's failure, as it said
    kinds = [type(a) for a in actions if isinstance(a, (DisconnectPeer, FreePages, ReleaseQuarantine))]
    assert kinds[0] is DisconnectPeer and of(actions, DisconnectPeer)[0].peer == PP
    assert sorted(freed(actions)) == list(DST)
    assert dec.peers.is_lost(PP)
    nxt = Peer(PP.name, PP.incarnation, PP.session + 1)
    dec.handle(RequestArrived(8, "r8", PROMPT), 2)
    dec.handle(PagesReserved(8, (20, 21)), 2)
    actions = dec.handle(PeerInfo(8, nxt), 2)
    assert [m.room for m in sent(actions, protocol.RegisterRoom, to=nxt)] == [8]
    assert dec.state_of(8) is DecodeState.AWAITING_KV
    assert notices(dec.handle(FromPeer(PP, protocol.WritesSettled(8, "p1")), 3), NoticeKind.FROM_LOST_PEER)


def test_rule5_a_new_decode_session_is_a_new_peer_and_the_lost_one_stays_lost():
    table = new_prefill()
    table.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    table.handle(FromPeer(DP, register()), 0)
    table.handle(PeerLost(DP, "silent"), 1)
    nxt = Peer(DP.name, DP.incarnation, DP.session + 1)
    table.handle(PeerHeard(nxt, fresh=True), 2)
    table.handle(RequestArrived(8, "r8", PROMPT), 2)
    assert not notices(table.handle(FromPeer(nxt, register(room=8)), 2), NoticeKind.FROM_LOST_PEER)
    assert table.state_of(8) is PrefillState.QUEUED
    table.handle(RequestArrived(9, "r9", PROMPT), 3)
    assert notices(table.handle(FromPeer(DP, register(room=9)), 3), NoticeKind.FROM_LOST_PEER)


def test_rule5_a_new_session_declares_the_older_one_lost():
    table = new_prefill()
    table.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    table.handle(FromPeer(DP, register()), 0)
    actions = table.handle(PeerHeard(Peer(DP.name, DP.incarnation, DP.session + 1), fresh=True), 1)
    assert of(actions, DisconnectPeer)[0].peer == DP
    assert_one_ending(actions, Reason.PEER_LOST)


def test_rule5_a_registration_meant_for_an_earlier_incarnation_is_rejected():
    table = new_prefill()
    table.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    actions = table.handle(FromPeer(DP, register(prefill_incarnation="p0")), 0)
    assert notices(actions, NoticeKind.STALE_INCARNATION)
    assert table.state_of(ROOM) is PrefillState.BOOTSTRAPPING


def test_rule5_a_pending_registration_from_a_lost_peer_refuses_its_request():
    table = new_prefill()
    table.handle(FromPeer(DP, register()), 0)
    table.expire(D.peer_silence_s)
    assert_one_ending(table.handle(RequestArrived(ROOM, RID, PROMPT), 6), Reason.PEER_LOST)


def test_rule5_a_decoding_room_does_not_depend_on_prefill_any_more():
    table = decode_in(DecodeState.DECODING)
    actions = table.expire(D.peer_silence_s + 1)  # prefill silent: nothing of ours depends on it
    assert not of(actions, LogTerminal) and table.state_of(ROOM) is DecodeState.DECODING


def test_rule5_incompatible_peer_fails_naming_the_field_and_tells_prefill():
    table = new_decode()
    table.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    table.handle(PagesReserved(ROOM, DST), 0)
    actions = table.handle(PeerInfo(ROOM, PP, mismatch="head_dim"), 0)
    assert_one_ending(actions, Reason.INCOMPATIBLE_PEER)
    assert "head_dim" in of(actions, NotifyClient)[0].ending.detail
    assert sent(actions, protocol.AbortRoom, to=PP)[0].reason == "incompatible_peer"
    assert freed(actions) == list(DST)  # never registered: nothing can be written there
    assert not sent(actions, protocol.RegisterRoom)


# == rule 6: memory is released exactly once; quarantine ===========================================


def test_rule6_decode_pages_are_quarantined_until_prefill_settles_its_writes():
    dec = decode_in(DecodeState.AWAITING_KV)
    actions = dec.handle(ClientAbort(ROOM), 1)
    assert of(actions, QuarantinePages)[0].pages == DST and not freed(actions)
    assert dec.counts_by_state()["quarantined_pages"] == 2
    assert not freed(dec.handle(FromPeer(PP, protocol.RoomFailed(ROOM, "p1", "peer_abort")), 2))
    actions = dec.handle(FromPeer(PP, protocol.WritesSettled(ROOM, "p1")), 3)
    assert of(actions, ReleaseQuarantine)[0].pages == DST
    assert dec.handle(FromPeer(PP, protocol.WritesSettled(ROOM, "p1")), 4) == [
        Notice(Role.DECODE, NoticeKind.LATE_MESSAGE, ROOM, f"WritesSettled from {PP}")]  # once only


def test_rule6_quarantine_never_times_out_while_the_peer_lives_and_the_abort_is_resent():
    dec = decode_in(DecodeState.AWAITING_KV)
    dec.handle(ClientAbort(ROOM), 0)
    resent = 0
    t = 0.0
    while t < 20 * D.quarantine_resend_s:
        t += D.heartbeat_interval_s
        dec.handle(PeerHeard(PP), t)
        actions = dec.expire(t)
        assert not freed(actions)
        resent += len(sent(actions, protocol.AbortRoom, to=PP))
    assert resent == 20 and dec.counts_by_state()["quarantined"] == 1
    assert dec.snapshot(t)[0]["holding"] == "quarantined"


def test_rule6_quarantine_ends_when_the_peer_is_declared_lost_after_the_disconnect():
    dec = decode_in(DecodeState.AWAITING_KV)
    dec.handle(ClientAbort(ROOM), 0)
    actions = dec.expire(D.peer_silence_s)
    kinds = [type(a) for a in actions if isinstance(a, (DisconnectPeer, ReleaseQuarantine))]
    assert kinds == [DisconnectPeer, ReleaseQuarantine]  # the fence first, then the pages


def test_rule6_kv_done_after_the_decode_abort_releases_the_quarantine():
    dec = decode_in(DecodeState.AWAITING_KV)
    dec.handle(ClientAbort(ROOM), 0)
    actions = dec.handle(FromPeer(PP, protocol.KVDone(ROOM, "p1", 42, PROMPT)), 1)
    assert of(actions, ReleaseQuarantine)[0].pages == DST and not of(actions, StartDecode)


def test_rule6_prefill_settles_its_writes_before_freeing_its_pages_and_telling_decode():
    pre = prefill_in(PrefillState.TRANSFERRING)  # writes 1 and 2 in flight
    actions = pre.handle(ClientAbort(ROOM), 1)
    assert of(actions, CancelWrites)[0].write_ids == (1, 2)
    assert sent(actions, protocol.RoomFailed) and not sent(actions, protocol.WritesSettled)
    assert not freed(actions) and pre.counts_by_state()["held_writes"] == 1
    assert not freed(pre.handle(WriteDone(ROOM, 1), 2))
    actions = pre.handle(WriteFailed(ROOM, 2, "cancelled"), 3)
    assert freed(actions) == list(SRC) and sent(actions, protocol.WritesSettled, to=DP)
    assert pre.counts_by_state()["held_writes"] == 0 and pre.live_rooms() == []


def test_rule6_unsettled_writes_end_the_session_so_that_decode_fences_it():
    """Writes that do not settle after the end cannot be vouched for: prefill never says
    WritesSettled for them. It declares the session lost (disconnect, which fails the writes),
    then keeps nudging the transport until they settle, and answers decode's re-sent abort with
    peer_lost, on which decode ends the session and fences it before freeing its pages."""
    pre = prefill_in(PrefillState.TRANSFERRING)
    pre.handle(ClientAbort(ROOM), 0)
    actions = tick(pre, D.write_drain_s)
    assert of(actions, DisconnectPeer)[0].peer == DP and notices(actions, NoticeKind.TRANSFER_RESET)
    assert pre.peers.is_lost(DP) and not freed(actions)
    actions = pre.expire(2 * D.write_drain_s)
    assert of(actions, ResetTransfer)[0].write_ids == (1, 2) and not freed(actions)
    answer = pre.handle(FromPeer(DP, protocol.AbortRoom(ROOM, DP.incarnation, "client_abort")), 61)
    assert [m.reason for m in sent(answer, protocol.RoomFailed, to=DP)] == ["peer_lost"]
    pre.handle(WriteFailed(ROOM, 1, "reset"), 61)
    actions = pre.handle(WriteFailed(ROOM, 2, "reset"), 61)
    assert freed(actions) == list(SRC) and not sent(actions, protocol.WritesSettled)

    dec = decode_in(DecodeState.AWAITING_KV)  # decode's side of it: quarantined until the fence
    dec.handle(ClientAbort(ROOM), 0)
    actions = dec.handle(FromPeer(PP, sent(answer, protocol.RoomFailed)[0]), 1)
    kinds = [type(a) for a in actions if isinstance(a, (DisconnectPeer, ReleaseQuarantine))]
    assert kinds == [DisconnectPeer, ReleaseQuarantine]


def test_rule6_every_page_is_freed_exactly_once_on_the_happy_path():
    pre, dec = prefill_in(PrefillState.TRANSFERRING), decode_in(DecodeState.AWAITING_KV)
    pre_out = pre.handle(WriteDone(ROOM, 2), 1) + pre.handle(WriteDone(ROOM, 1), 1)
    [kv_done] = sent(pre_out, protocol.KVDone, to=DP)
    dec_out = dec.handle(FromPeer(PP, kv_done), 2)
    assert of(dec_out, StartDecode)[0].first_token == 42
    dec_out += dec.handle(DecodeStep(ROOM, (12,)), 3) + dec.handle(Finished(ROOM, Reason.STOP), 4)
    assert freed(pre_out) == list(SRC) and freed(dec_out) == [*DST, 12]
    assert_one_ending(pre_out, Reason.TRANSFERRED)
    assert_one_ending(dec_out, Reason.STOP)


def test_rule6_pages_an_event_brings_to_an_ended_room_are_freed_not_leaked():
    pre = prefill_in(PrefillState.QUEUED)
    pre.handle(ClientAbort(ROOM), 1)
    actions = pre.handle(Scheduled(ROOM, (300, 301)), 2)  # the scheduler raced the abort
    assert freed(actions) == [300, 301] and notices(actions, NoticeKind.OUT_OF_ORDER)
    dec = decode_in(DecodeState.PREALLOC, with_pages=False)
    dec.handle(ClientAbort(ROOM), 1)
    assert freed(dec.handle(PagesReserved(ROOM, (50, 51)), 2)) == [50, 51]
    assert freed(dec.handle(DecodeStep(ROOM, (52,)), 2)) == [52]


def test_rule6_decode_pages_never_registered_are_freed_at_once():
    dec = decode_in(DecodeState.PREALLOC)  # pages, no info yet: nothing was sent to prefill
    actions = dec.handle(ClientAbort(ROOM), 1)
    assert freed(actions) == list(DST) and not of(actions, QuarantinePages)


def test_rule6_a_promise_made_from_a_tombstone_keeps_it_a_full_lifetime():
    """Prefill tells decode "nothing will be written" from a tombstone; a registration decode sent
    before hearing that may still be on its way, so the tombstone must outlive the promise by a
    full lifetime, or the registration would be accepted and written into pages decode freed."""
    table = new_prefill()
    table.handle(ClientAbort(ROOM), 0)  # tombstone until 900
    actions = table.handle(FromPeer(DP, protocol.AbortRoom(ROOM, DP.incarnation, "transfer_timeout")), 500)
    assert sent(actions, protocol.WritesSettled, to=DP)  # the promise, at 500
    table.expire(1000)
    actions = table.handle(FromPeer(DP, register()), 1000)  # sent before 500, arriving at 1000
    assert sent(actions, protocol.RoomFailed, to=DP) and table.counts_by_state()["pending_registrations"] == 0
    table.handle(RequestArrived(ROOM, RID, PROMPT), 1001)
    assert table.state_of(ROOM) is Outcome.ABORTED  # refused: nothing is ever written


def test_rule6_kv_for_another_prompt_fails_the_room_check():
    dec = decode_in(DecodeState.AWAITING_KV)
    actions = dec.handle(FromPeer(PP, protocol.KVDone(ROOM, "p1", 42, PROMPT + 1)), 1)
    assert_one_ending(actions, Reason.TRANSFER_ERROR)
    assert not of(actions, StartDecode) and freed(actions) == list(DST)  # every write has completed


def test_rule6_a_registration_for_another_prompt_is_refused_before_any_write():
    pre = new_prefill()
    pre.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    actions = pre.handle(FromPeer(DP, register(prompt_len=PROMPT + 4, pages=(1, 2, 3))), 0)
    assert_one_ending(actions, Reason.BAD_REQUEST)
    assert "prompt length differs" in of(actions, NotifyClient)[0].ending.detail
    assert [type(m) for m in sent(actions, to=DP)] == [protocol.RoomFailed, protocol.WritesSettled]


# == rule 7: nothing ends silently; gauges from the same structures =================================


def test_rule7_every_ending_has_one_log_line_one_count_and_one_answer():
    scenarios = [
        (prefill_in(PrefillState.QUEUED), LocalFailure(ROOM, Reason.OVERLOADED), Reason.OVERLOADED),
        (prefill_in(PrefillState.TRANSFERRING), WriteFailed(ROOM, 1, "link down"), Reason.TRANSFER_ERROR),
        (decode_in(DecodeState.DECODING), Finished(ROOM, Reason.LENGTH), Reason.LENGTH),
        (decode_in(DecodeState.AWAITING_KV), PeerLost(PP, "reset"), Reason.PEER_LOST),
    ]
    for table, event, reason in scenarios:
        actions = table.handle(event, 5)
        assert_one_ending(actions, reason)
        [log] = of(actions, LogTerminal)
        assert log.age_s == 5 and log.last_state is not None
        assert f"room={ROOM}" in log.line() and reason.value in log.line() and RID in log.line()
        [moved] = [a for a in actions if isinstance(a, Moved)]
        assert moved.before is log.last_state and moved.after is log.ending.outcome and moved.ending == log.ending


def test_rule7_gauges_and_debug_snapshot_come_from_the_table():
    pre = new_prefill()
    pre.handle(RequestArrived(1, "r1", PROMPT), 0)
    pre.handle(RequestArrived(2, "r2", PROMPT), 10)
    pre.handle(FromPeer(DP, register(room=2)), 10)
    pre.handle(FromPeer(DP, register(room=3)), 10)  # pending
    counts = pre.counts_by_state()
    assert counts["BOOTSTRAPPING"] == 1 and counts["QUEUED"] == 1 and counts["PREFILLING"] == 0
    assert counts["pending_registrations"] == 1 and counts["held_writes"] == 0
    rows = {r["room"]: r for r in pre.snapshot(40)}
    assert rows[1] == {"rid": "r1", "room": 1, "role": "prefill", "state": "BOOTSTRAPPING", "age_s": 40,
                       "state_age_s": 40, "deadline_s": D.bootstrap_s - 40, "late": True, "peer": None,
                       "holding": None, "ending": None}
    assert rows[2]["state"] == "QUEUED" and rows[2]["late"] is False and rows[2]["peer"] == str(DP)
    assert rows[2]["deadline_s"] == pytest.approx(D.queue_s - 30)


def test_rule7_refused_and_duplicate_requests_are_logged_too():
    pre = prefill_in(PrefillState.QUEUED)
    actions = pre.handle(RequestArrived(ROOM, "someone-else", PROMPT), 1)
    assert_one_ending(actions, Reason.BAD_REQUEST)
    assert of(actions, NotifyClient)[0].rid == "someone-else"
    assert pre.state_of(ROOM) is PrefillState.QUEUED  # the live request is untouched


# == rule 8: what a supervisor reports fails the rooms it touched ===================================


def test_rule8_a_transfer_thread_failure_fails_its_rooms_and_tells_decode():
    pre = prefill_in(PrefillState.PREFILLING)  # write 1 in flight
    actions = pre.handle(WriteFailed(ROOM, 1, "transfer thread died: restarted"), 2)
    assert_one_ending(actions, Reason.TRANSFER_ERROR)
    assert sent(actions, protocol.RoomFailed, to=DP)[0].reason == "transfer_error"
    assert freed(actions) == list(SRC) and sent(actions, protocol.WritesSettled, to=DP)


def test_rule8_an_engine_exception_fails_the_room_it_touched():
    dec = decode_in(DecodeState.DECODING)
    actions = dec.handle(LocalFailure(ROOM, Reason.INTERNAL_ERROR, "RuntimeError in forward"), 2)
    assert_one_ending(actions, Reason.INTERNAL_ERROR)
    assert of(actions, Cancel) and freed(actions) == list(DST)


# == peers ==========================================================================================


def test_peer_table_tracks_only_peers_with_rooms_and_forgets_lost_ones_after_a_tombstone():
    peers = PeerTable(D)
    peers.heard(PP, 0)
    assert len(peers) == 0 and peers.next_due() is None
    peers.bind(PP, 1, 0)
    peers.bind(PP, 2, 0)
    assert peers.snapshot(3.5)[0] == {"peer": str(PP), "rooms": 2, "silent_s": 3.5, "misses": 3}
    [(lost, rooms)] = peers.expire(D.peer_silence_s)
    assert lost == PP and rooms == {1, 2} and peers.is_lost(PP)
    peers.expire(D.peer_silence_s + D.tombstone_s)
    assert not peers.is_lost(PP) and peers.next_due() is None


def test_reserve_and_enqueue_ask_the_engine_for_work():
    dec = new_decode()
    assert of(dec.handle(RequestArrived(ROOM, RID, 9), 0), ReservePages) == [ReservePages(ROOM, 3)]
    pre = new_prefill()
    pre.handle(RequestArrived(ROOM, RID, PROMPT), 0)
    assert of(pre.handle(FromPeer(DP, register()), 0), Enqueue) == [Enqueue(ROOM, RID)]
    pre.handle(Scheduled(ROOM, SRC), 0)
    assert of(pre.handle(ChunkDone(ROOM, 1), 1), StartWrite) == [StartWrite(ROOM, 1, DP, SRC[:1], DST[:1])]
    assert of(pre.handle(ChunkDone(ROOM, 1), 2), StartWrite) == []  # nothing new is full


# -- caps on what peers can make us remember (docs/security.md) -------------------------------------

CAPS = dataclasses.replace(D, max_pending_registrations=3, max_pending_registrations_per_peer=2,
                           max_peer_tombstones=3, max_peer_tombstones_per_peer=2)
DP2, DP3 = Peer("decode-1:7100", "d2"), Peer("decode-2:7100", "d3")


def register_from(peer, room):
    return FromPeer(peer, protocol.RegisterRoom(room, peer.incarnation, "p1", f"r{room}", PROMPT, list(DST), 0))


def abort_from(peer, room):
    return FromPeer(peer, protocol.AbortRoom(room, peer.incarnation, Reason.CLIENT_ABORT.value))


def test_caps_pending_registrations_per_peer_and_in_total_and_a_dropped_one_is_taken_when_sent_again():
    table = new_prefill(CAPS)
    for room in (1, 2):
        assert not notices(table.handle(register_from(DP, room), 0), NoticeKind.CAPPED)
    capped = table.handle(register_from(DP, 3), 0)  # DP's third: over its cap of 2
    assert notices(capped, NoticeKind.CAPPED) and not sent(capped) and table.counts_by_state()["pending_registrations"] == 2
    assert not notices(table.handle(register_from(DP2, 4), 0), NoticeKind.CAPPED)
    assert notices(table.handle(register_from(DP3, 5), 0), NoticeKind.CAPPED)  # a new identity meets the total
    table.handle(RequestArrived(1, "r1", PROMPT), 1)  # room 1's request: its registration is used
    assert table.state_of(1) is PrefillState.QUEUED
    assert not notices(table.handle(register_from(DP, 3), 2), NoticeKind.CAPPED)  # decode's re-send is taken
    table.handle(RequestArrived(3, "r3", PROMPT), 3)
    assert table.state_of(3) is PrefillState.QUEUED


def test_caps_peer_tombstones_drop_an_abort_for_an_unseen_room_unanswered_and_never_our_own():
    table = new_prefill(CAPS)
    for room in (10, 11):
        actions = table.handle(abort_from(DP, room), 0)
        assert sent(actions, protocol.WritesSettled) and notices(actions, NoticeKind.TOMBSTONE)
    capped = table.handle(abort_from(DP, 12), 0)
    assert notices(capped, NoticeKind.CAPPED) and not sent(capped)  # no promise without its tombstone
    assert table.counts_by_state()["tombstones"] == 2
    table.handle(abort_from(DP2, 13), 0)
    assert notices(table.handle(abort_from(DP3, 14), 0), NoticeKind.CAPPED)  # the total
    table.handle(register_from(DP, 20), 0)  # an abort for a room with a pending registration is never capped
    actions = table.handle(abort_from(DP, 20), 0)
    assert sent(actions, protocol.WritesSettled) and not notices(actions, NoticeKind.CAPPED)
    for room in (30, 31, 32):  # our own rooms' tombstones are never refused nor counted
        table.handle(ClientAbort(room), 0)
    assert table.counts_by_state()["tombstones"] == 3 + 1 + 3
    table.handle(RequestArrived(12, "r12", PROMPT), 1)  # the dropped abort's request still ends in time
    assert table.state_of(12) is PrefillState.BOOTSTRAPPING
    table.expire(D.tombstone_s + 1)  # tombstones gone, and what they counted against their peers
    assert not notices(table.handle(abort_from(DP3, 15), D.tombstone_s + 2), NoticeKind.CAPPED)


def test_caps_a_prefill_s_failures_for_unseen_rooms_are_capped_on_decode_too():
    table = new_decode(CAPS)
    failed = [table.handle(FromPeer(PP, protocol.RoomFailed(room, PP.incarnation, "overloaded")), 0)
              for room in (1, 2, 3)]
    assert [bool(notices(a, NoticeKind.TOMBSTONE)) for a in failed] == [True, True, False]
    assert notices(failed[2], NoticeKind.CAPPED) and table.counts_by_state()["tombstones"] == 2
