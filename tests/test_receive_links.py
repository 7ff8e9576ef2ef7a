"""Receiving links (``splitserve/disagg/transfer/links.py``): closing a writer's link is a fence.

A writer process keeps writing into our pool through link A while the test closes A; from then on
not one byte of A's may land (the pool region is zeroed after the close and must stay zero while
the writer goes on), and link B of the same pool, open all along, still carries a write and its
notification. NIXL runs with ``UCX_TLS=tcp`` across two processes, the way a partition would cut it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from splitserve.disagg.transfer.base import Span
from splitserve.disagg.transfer.links import ReceiveLinks

POOL = 8 << 20
HALF = POOL // 2


def _writer(backend: str, mds: dict, fenced, report) -> None:
    """Child: write 7s into the first half through link A until told A is closed, go on for a
    second, then write 9s into the second half through link B with a notification."""
    os.environ["UCX_TLS"] = "tcp"
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")
    from splitserve.disagg.transfer.base import create_backend

    src = torch.cat([torch.full((HALF,), 7, dtype=torch.uint8), torch.full((HALF,), 9, dtype=torch.uint8)])
    opts = {"host": "127.0.0.1"} if backend == "tcp" else {}
    wa, wb = create_backend(backend, "writer-a", src, **opts), create_backend(backend, "writer-b", src, **opts)
    (a_name, a_md), (b_name, b_md) = mds["A"], mds["B"]
    wa.add_peer(a_name, a_md)
    wb.add_peer(b_name, b_md)
    after_close: dict[str, int] = {}
    closed_at = None
    while closed_at is None or time.monotonic() - closed_at < 1.0:
        if closed_at is None and fenced.is_set():
            closed_at = time.monotonic()
        h = wa.write(a_name, [Span(0, 0, HALF)], b"")
        t0 = time.monotonic()
        while wa.poll(h).pending and time.monotonic() - t0 < 0.2:
            time.sleep(0.001)
        if closed_at is not None:
            key = str(wa.poll(h)).split(":")[0]
            after_close[key] = after_close.get(key, 0) + 1
        wa.release(h)
    h = wb.write(b_name, [Span(HALF, HALF, HALF)], b"b-done")
    t0 = time.monotonic()
    while wb.poll(h).pending and time.monotonic() - t0 < 10:
        time.sleep(0.001)
    report.put({"a_after_close": after_close, "b": str(wb.poll(h))})
    for w in (wa, wb):
        w.close()


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_closing_a_link_fences_its_writer_and_spares_the_others(backend):
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")
    pool = torch.zeros(POOL, dtype=torch.uint8)
    opts = {"host": "127.0.0.1"} if backend == "tcp" else {}
    links = ReceiveLinks(backend, f"recv-{backend}", pool, **opts)
    ctx = mp.get_context("spawn")
    fenced, report = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_writer, args=(backend, {"A": links.open("A"), "B": links.open("B")}, fenced, report))
    proc.start()
    try:
        notifs = []

        def pump(until, timeout: float, what: str) -> None:
            deadline = time.monotonic() + timeout
            while not until():
                assert time.monotonic() < deadline, f"{what} within {timeout}s"
                notifs.extend(links.notifications())
                time.sleep(0.001)

        pump(lambda: bool(pool[:HALF].all()), 60, "a whole write through link A lands")
        assert links.close("A") is True
        pool[:HALF] = 0
        fenced.set()
        pump(lambda: any(n[2] == b"b-done" for n in notifs), 60, "link B's write and notification arrive")
        landed_after_close = int(pool[:HALF].count_nonzero())
        assert landed_after_close == 0, f"{landed_after_close} bytes of link A landed after it was closed"
        assert bool((pool[HALF:] == 9).all()), "link B's bytes did not land"
        assert [n[0] for n in notifs if n[2] == b"b-done"] == ["B"]
        result = report.get(timeout=30)
        assert result["b"] == "DONE", result
        assert sum(result["a_after_close"].values()) > 0, f"the writer stopped writing through A: {result}"
        if backend == "nixl":  # the writer learns: its writes to a closed link fail
            assert "FAILED(transfer_error" in result["a_after_close"], result
        print(f"\n{backend}: writes through link A after its close: {result['a_after_close']}; none landed")
        assert links.writers() == ["B"] and links.close("A") is False
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        links.close_all()
    assert proc.exitcode == 0


def test_fake_backend_link_refuses_writes_once_closed():
    from splitserve.disagg.transfer.fake import FakeBackend

    pool = torch.zeros(4096, dtype=torch.uint8)
    links = ReceiveLinks("fake", "recv-fake", pool)
    name, md = links.open("A")
    with FakeBackend("fake-writer", torch.full((4096,), 5, dtype=torch.uint8)) as w:
        w.add_peer(name, md)
        w.stall_next()
        late = w.write(name, [Span(0, 0, 4096)], b"late")
        assert links.close("A")
        assert w.complete(late).failed and int(pool.count_nonzero()) == 0
    assert links.notifications() == []
    with pytest.raises(RuntimeError):
        links.close_all() or links.open("B")


def _frozen_writer(md, ready) -> None:
    """Child: write 7s through the link as fast as it can, until killed. It keeps UCX's defaults,
    so it would use shared memory (``cma``) into a pool on this host if the link offered it."""
    os.environ.pop("UCX_TLS", None)
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")
    from splitserve.disagg.transfer.base import create_backend

    src = torch.full((POOL,), 7, dtype=torch.uint8)
    w = create_backend("nixl", "frozen-writer", src)
    w.add_peer(*md)
    spans = [Span(i, i, 4096) for i in range(0, POOL, 8192)]  # many descriptors: a write takes a while
    while True:
        h = w.write(md[0], spans, b"")
        while w.poll(h).pending:
            pass
        ready.set()
        w.release(h)


def test_a_frozen_same_host_writer_cannot_write_after_its_link_closed(monkeypatch):
    """A writer on this host is frozen (SIGSTOP) in the middle of its writes, declared lost: its
    link is closed and its pages reused (zeroed). When it runs again (SIGCONT), not one byte may
    land. Closing the link fences a same-host writer only because links never offer UCX's
    shared-memory transports (``links.py``); the writer itself runs with UCX's defaults."""
    pytest.importorskip("nixl_cu12")
    import signal

    monkeypatch.setenv("UCX_TLS", "")  # records the variable's state, so that it is restored afterwards
    monkeypatch.delenv("UCX_TLS")  # as in a decode worker started without it: the links choose
    pool = torch.zeros(POOL, dtype=torch.uint8)
    links = ReceiveLinks("nixl", "recv-frozen", pool)
    assert os.environ.get("UCX_TLS") == "^sm"
    ctx = mp.get_context("spawn")
    landed = []
    try:
        for trial in range(1):
            md = links.open(f"W{trial}")
            ready = ctx.Event()
            proc = ctx.Process(target=_frozen_writer, args=(md, ready))
            proc.start()
            try:
                deadline = time.monotonic() + 60
                while not ready.is_set():
                    assert time.monotonic() < deadline, "the writer never finished a write"
                    links.notifications()
                    time.sleep(0.001)
                time.sleep(0.02 * (trial + 1))  # somewhere in the middle of a write
                os.kill(proc.pid, signal.SIGSTOP)
                assert links.close(f"W{trial}")
                pool.zero_()
                os.kill(proc.pid, signal.SIGCONT)
                time.sleep(1.5)
                landed.append(int(pool.count_nonzero()))
            finally:
                proc.kill()
                proc.join(10)
    finally:
        links.close_all()
    assert landed == [0], f"bytes landed after the fence: {landed}"
