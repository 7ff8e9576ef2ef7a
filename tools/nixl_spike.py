"""Spike: one NIXL WRITE of CPU memory between two processes, with a notification.

What it checks, in order (each step prints a line):

1. ``nixl`` imports (as ``nixl`` or, with only the ``nixl-cu12`` wheel installed, ``nixl_cu12``)
   and an agent with the UCX backend starts in each process;
2. each process registers one CPU (DRAM) buffer;
3. the target (process B) sends its agent metadata and buffer address to the initiator (process A)
   through a ``multiprocessing`` pipe; A loads it with ``add_remote_agent``;
4. A WRITEs a few scattered spans of its buffer into B's buffer with one notification, polling
   ``check_xfer_state`` until DONE;
5. B waits for the notification (``get_new_notifs``), checks every byte that should have landed
   and that the bytes around them were not touched, and reports back.

Run::

    .venv/bin/python tools/nixl_spike.py            # UCX picks its transports
    UCX_TLS=tcp .venv/bin/python tools/nixl_spike.py  # force TCP (e.g. across network namespaces)

Exit status 0 when every check passed.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np

BUF_BYTES = 1 << 20
# (src_offset, dst_offset, nbytes): scattered, different offsets on each side.
SPANS = [(0, 4096, 4096), (65536, 8192, 8192), (200_000, 900_000, 1000)]
NOTIF = b"room=42;last=1"


def _nixl_api() -> Any:
    for name in ("nixl._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise SystemExit("nixl is not importable (pip install nixl-cu12)")


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def target(conn) -> None:
    """Process B: register a zeroed buffer, publish metadata, wait for the notification, check."""
    api = _nixl_api()
    agent = api.nixl_agent("spike-B", api.nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(BUF_BYTES, dtype=np.uint8)
    base = buf.ctypes.data
    agent.register_memory([(base, BUF_BYTES, 0, "")], "DRAM")
    conn.send({"md": agent.get_agent_metadata(), "base": base, "nbytes": BUF_BYTES})

    deadline = time.monotonic() + 20
    got: dict[str, list[bytes]] = {}
    while time.monotonic() < deadline:
        for peer, msgs in agent.get_new_notifs().items():
            got.setdefault(peer, []).extend(msgs)
        if got:
            break
        time.sleep(0.001)
    report: dict[str, Any] = {"notifs": got}
    expect = np.zeros(BUF_BYTES, dtype=np.uint8)
    src = _pattern(BUF_BYTES, seed=1)
    for s, d, n in SPANS:
        expect[d : d + n] = src[s : s + n]
    report["bytes_ok"] = bool(np.array_equal(buf, expect))
    report["bytes_written"] = int(np.count_nonzero(buf))
    conn.send(report)
    conn.recv()  # stay alive until A has finished with us


def main() -> int:
    api = _nixl_api()
    print(f"[1] nixl module: {api.__name__}")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,), daemon=True)
    proc.start()

    agent = api.nixl_agent("spike-A", api.nixl_agent_config(backends=["UCX"]))
    print(f"[1] agent spike-A up; UCX memory types: {agent.get_backend_mem_types('UCX')}")
    buf = _pattern(BUF_BYTES, seed=1)
    base = buf.ctypes.data
    agent.register_memory([(base, BUF_BYTES, 0, "")], "DRAM")
    print(f"[2] registered {BUF_BYTES} B of DRAM at 0x{base:x}")

    info = parent.recv()
    peer = agent.add_remote_agent(info["md"])
    print(f"[3] loaded remote agent {peer!r} ({len(info['md'])} B metadata), its buffer 0x{info['base']:x}")

    src = np.array([(base + s, n, 0) for s, _, n in SPANS], dtype=np.uint64)
    dst = np.array([(info["base"] + d, n, 0) for _, d, n in SPANS], dtype=np.uint64)
    t0 = time.perf_counter()
    handle = agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs(src, "DRAM"), agent.get_xfer_descs(dst, "DRAM"), "spike-B", NOTIF
    )
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    dt = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    print(f"[4] WRITE of {len(SPANS)} spans ({sum(n for *_, n in SPANS)} B) -> {state} in {dt * 1e3:.2f} ms")

    report = parent.recv()
    parent.send("bye")
    proc.join(10)
    print(f"[5] B got notifications {report['notifs']}, bytes_ok={report['bytes_ok']}, "
          f"nonzero bytes={report['bytes_written']}")
    ok = state == "DONE" and report["bytes_ok"] and report["notifs"] == {"spike-A": [NOTIF]}
    print("SPIKE OK" if ok else "SPIKE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
