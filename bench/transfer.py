"""KV transfer throughput for one request's scattered pages, against references measured in the same run.

One process, two NIXL agents (a "prefill" pool and a "decode" pool, each a page-major KV pool as in
``engine/kv_pool.py``), UCX backend on CPU memory. The request's pages sit in both pools in runs
of 1-4 pages in random order, like a page allocator after churn; ``page_spans`` merges what is
consecutive on both sides. Rows:

* ``nixl backend``      our path: ``NixlBackend.write`` of the merged spans, polled to DONE and
                        timed until the receiver has the notification;
* ``raw nixl, 1 desc``  the same bytes as ONE contiguous raw NIXL write (the best NIXL can do);
* ``raw nixl, layer-major`` the same spans cut into one descriptor per (layer, K/V) each, i.e.
                        what a layer-major pool would need (same bytes, x ``2*layers`` descriptors);
* ``raw nixl, 4 KiB``   the same bytes as 4 KiB descriptors (docs/design.md §3: scattered case);
* ``torch copy``        one contiguous ``Tensor.copy_`` of the same bytes (memory bandwidth);
* ``tcp backend``       our ZMQ backend over loopback, same spans (``--no-tcp`` skips it).

Each row: median of ``--iters`` timed runs after one warm-up; bytes are checked after each path.
No assertions on timing: this prints figures and ratios to the raw contiguous NIXL write.

    .venv/bin/python bench/transfer.py [--request-pages 32] [--iters 5] [--no-tcp]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.disagg.transfer import Span, TransferBackend, get_backend, page_spans  # noqa: E402
from splitserve.engine.kv_pool import KVLayout, KVPool  # noqa: E402


def scattered_pages(num_pages: int, want: int, rng: random.Random) -> list[int]:
    """``want`` page ids taken as runs of 1-4 consecutive pages, runs in random order."""
    runs, p = [], 0
    while p < num_pages:
        n = min(rng.randint(1, 4), num_pages - p)
        runs.append(list(range(p, p + n)))
        p += n
    rng.shuffle(runs)
    pages = [pg for run in runs for pg in run]
    return pages[:want]


def median_time(fn: Callable[[], None], iters: int) -> float:
    fn()  # warm-up: connection setup, first-touch
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_backend_write(a: TransferBackend, b: TransferBackend, spans: list[Span], timeout: float = 60.0) -> None:
    h = a.write(b.agent_name, spans, b"bench")
    deadline = time.monotonic() + timeout
    got: list = []
    while True:
        state = a.poll(h)
        got += b.notifications()  # the receiver's transfer thread would do this; it also drives NIXL
        if state.failed:
            raise RuntimeError(f"{a.name} write failed: {state.reason}")
        if state.done and got:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{a.name} write still {state} after {timeout}s")
    a.release(h)


class RawNixl:
    """Two bare NIXL agents over the same two pools, for reference writes."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor):
        from splitserve.disagg.transfer.nixl import _api

        cfg = _api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.a, self.b = _api.nixl_agent("bench-raw-a", cfg), _api.nixl_agent("bench-raw-b", cfg)
        self.src, self.dst = src.data_ptr(), dst.data_ptr()
        self.regs = (self.a.register_memory(src), self.b.register_memory(dst))
        self.a.add_remote_agent(self.b.get_agent_metadata())

    def write(self, rows: np.ndarray) -> None:
        """rows: [n, 3] (local offset, remote offset, nbytes)."""
        local = np.stack([rows[:, 0] + self.src, rows[:, 2], np.zeros(len(rows), np.uint64)], axis=1)
        remote = np.stack([rows[:, 1] + self.dst, rows[:, 2], np.zeros(len(rows), np.uint64)], axis=1)
        h = self.a.initialize_xfer("WRITE", self.a.get_xfer_descs(local, "DRAM"),
                                   self.a.get_xfer_descs(remote, "DRAM"), "bench-raw-b", b"raw")
        state = self.a.transfer(h)
        got = False
        while state == "PROC" or not got:
            if state == "PROC":
                state = self.a.check_xfer_state(h)
            got = got or bool(self.b.get_new_notifs())
            if state == "ERR":
                raise RuntimeError("raw NIXL write failed")
        self.a.release_xfer_handle(h)

    def close(self) -> None:
        self.a.remove_remote_agent("bench-raw-b")
        self.a.deregister_memory(self.regs[0])
        self.b.deregister_memory(self.regs[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=128)
    ap.add_argument("--request-pages", type=int, default=32)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tcp", action="store_true")
    ap.add_argument("--progress-thread", action="store_true", help="NIXL progress thread (busy-polls a core)")
    args = ap.parse_args()

    layout = KVLayout(args.pool_pages, args.layers, args.page_size, args.kv_heads, args.head_dim, torch.float16)
    P = layout.page_nbytes
    src, dst = KVPool(layout), KVPool(layout)
    for p in range(layout.num_pages):
        src.page_bytes(p).fill_(p % 251 + 1)
    rng = random.Random(args.seed)
    local = scattered_pages(layout.num_pages, args.request_pages, rng)
    remote = scattered_pages(layout.num_pages, args.request_pages, rng)
    spans = page_spans(local, remote, P)
    nbytes = sum(s.nbytes for s in spans)
    rows = np.array([(s.local_offset, s.remote_offset, s.nbytes) for s in spans], dtype=np.uint64)
    print(f"layout: {layout.num_layers} layers x {layout.num_kv_heads} kv heads x {layout.head_dim} head_dim x fp16, "
          f"page_size {layout.page_size} -> page {P / 2**20:.2f} MiB; pool {layout.num_pages} pages "
          f"({src.nbytes / 2**20:.0f} MiB) per side")
    print(f"request: {len(local)} pages = {nbytes / 2**20:.1f} MiB, runs of 1-4 pages on each side -> "
          f"{len(spans)} merged spans; one process, two NIXL agents (UCX, DRAM)\n")

    def check() -> None:
        for lp, rp in zip(local, remote):
            if not torch.equal(dst.page_bytes(rp), src.page_bytes(lp)):
                raise RuntimeError(f"page {lp}->{rp} differs")
        dst.buffer.zero_()

    results: list[tuple[str, int, float]] = []  # (name, descriptors, seconds)

    Nixl = get_backend("nixl")
    a = Nixl("bench-prefill", src.buffer, progress_thread=args.progress_thread)
    b = Nixl("bench-decode", dst.buffer, progress_thread=args.progress_thread)
    a.add_peer(b.agent_name, b.metadata())
    results.append(("nixl backend (merged spans)", len(spans),
                    median_time(lambda: run_backend_write(a, b, spans), args.iters)))
    check()
    a.close()
    b.close()

    raw = RawNixl(src.buffer, dst.buffer)
    one = np.array([(0, 0, nbytes)], dtype=np.uint64)
    results.append(("raw nixl, 1 contiguous desc", 1, median_time(lambda: raw.write(one), args.iters)))
    # a layer-major pool needs one descriptor per (run, layer, K/V), each run_pages * per_layer bytes:
    # the same bytes as the merged spans, each span cut into 2*layers equal pieces
    cuts = 2 * layout.num_layers
    lm = np.array([(s.local_offset + k * (s.nbytes // cuts), s.remote_offset + k * (s.nbytes // cuts), s.nbytes // cuts)
                   for s in spans for k in range(cuts)], dtype=np.uint64)
    results.append(("raw nixl, layer-major descs", len(lm), median_time(lambda: raw.write(lm), args.iters)))
    check()
    small = 4096  # docs/design.md §3: measurement: the same bytes as 4 KiB descriptors
    tiny = np.array([(s.local_offset + o, s.remote_offset + o, small) for s in spans
                     for o in range(0, s.nbytes, small)], dtype=np.uint64)
    results.append(("raw nixl, 4 KiB descs", len(tiny), median_time(lambda: raw.write(tiny), args.iters)))
    check()
    raw.close()

    flat_src, flat_dst = src.buffer.view(-1).view(torch.uint8), dst.buffer.view(-1).view(torch.uint8)
    results.append(("torch copy, contiguous", 1,
                    median_time(lambda: flat_dst[:nbytes].copy_(flat_src[:nbytes]), args.iters)))
    dst.buffer.zero_()

    if not args.no_tcp:
        Tcp = get_backend("tcp")
        ta, tb = Tcp("bench-tcp-prefill", src.buffer), Tcp("bench-tcp-decode", dst.buffer)
        ta.add_peer(tb.agent_name, tb.metadata())
        results.append(("tcp backend (loopback, zmq)", len(spans),
                        median_time(lambda: run_backend_write(ta, tb, spans), max(1, args.iters // 2))))
        check()
        ta.close()
        tb.close()

    ref = results[1][2]
    print(f"{'path':32} {'descs':>6} {'MiB':>7} {'ms':>9} {'GB/s':>7} {'vs raw 1-desc':>14}")
    for name, descs, secs in results:
        print(f"{name:32} {descs:6d} {nbytes / 2**20:7.1f} {secs * 1e3:9.2f} {nbytes / secs / 1e9:7.2f} "
              f"{ref / secs:13.2f}x")


if __name__ == "__main__":
    main()
