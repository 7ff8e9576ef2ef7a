"""CPU placement: which CPUs a worker process runs on and how many threads torch uses there.

A worker takes ``--cpus 0-3,6`` (its CPU affinity) and ``--threads N`` (torch intra-op threads);
unset, it keeps the CPUs it was started with and uses one thread per CPU. :func:`place_process`
applies both once, at the start of ``splitserve serve``, before the engine, the event loop or
torch's thread pool exist: the affinity is set on every thread of the process (Linux affinity is
per thread, and a thread inherits its creator's), so every thread started later inherits it.

Two workers on one host that each spin one thread per core fight over every core (OpenMP threads
spin-wait, so an oversubscribed core wastes time on both). :func:`split_between_workers` gives each
worker of ``splitserve launch`` its own CPUs out of those launch may use, an equal share each; when
there are fewer CPUs than workers they share, one CPU each in turn, and the caller says so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...]
    """The CPUs the process may run on, ascending."""
    threads: int
    """torch intra-op threads."""

    def describe(self) -> str:
        return f"CPUs {format_cpu_list(self.cpus)}, {self.threads} torch thread{'s' if self.threads != 1 else ''}"


def parse_cpu_list(text: str, option: str = "--cpus") -> tuple[int, ...]:
    """``"0-3,6"`` -> ``(0, 1, 2, 3, 6)`` (the kernel's cpu-list syntax, as in ``taskset -c``);
    a ValueError naming ``option`` for anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{option} {text!r}: {part!r} is not a CPU number or a range like 0-3 "
                             f"(expected a list such as 0-3,6)") from None
        if first < 0 or last < first:
            raise ValueError(f"{option} {text!r}: {part!r} is not a valid range (expected a list such as 0-3,6)")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Sequence[int]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0-3,6"``."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on now (its affinity; every CPU where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def check_cpus(text: str, allowed: Sequence[int], option: str = "--cpus") -> tuple[int, ...]:
    """Parse ``text`` and require every CPU in it to be in ``allowed``."""
    cpus = parse_cpu_list(text, option)
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"{option} {text}: CPU{'s' if len(outside) > 1 else ''} {format_cpu_list(outside)} "
                         f"{'are' if len(outside) > 1 else 'is'} not available to this process "
                         f"(it may run on {format_cpu_list(allowed)})")
    return cpus


def place_process(cpus: Optional[str] = None, threads: Optional[int] = None) -> Placement:
    """Pin this process to ``cpus`` (None: keep its CPUs) and give torch ``threads`` threads
    (None: one per CPU). Call it before the process starts threads of its own. ValueError for a
    bad list, CPUs outside the process's affinity, or ``threads`` < 1."""
    allowed = allowed_cpus()
    chosen = allowed if cpus is None else check_cpus(cpus, allowed)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads}: need at least 1")
    if cpus is not None:
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("--cpus: this platform has no CPU affinity (os.sched_setaffinity)")
        _set_affinity_of_every_thread(chosen)
    n = threads if threads is not None else len(chosen)
    if n > len(chosen):
        log.warning("--threads %d on %d CPU%s: threads will share cores", n, len(chosen), "s" * (len(chosen) > 1))
    import torch

    torch.set_num_threads(n)
    return Placement(chosen, n)


def current_placement() -> Placement:
    """What is in effect now, read back from the kernel and torch (for ``/get_server_info``)."""
    import torch

    return Placement(allowed_cpus(), torch.get_num_threads())


def _set_affinity_of_every_thread(cpus: Sequence[int]) -> None:
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread (and what it starts from now on) only
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def split_between_workers(cpus: Sequence[int], workers: int) -> tuple[list[tuple[int, ...]], Optional[str]]:
    """``workers`` CPU sets out of ``cpus``: disjoint runs of consecutive CPUs, an equal share each
    (the first workers get one more when it does not divide). Fewer CPUs than workers: each gets
    one CPU, in turn, shared; the second value then says so (else None)."""
    cpus = tuple(sorted(set(cpus)))
    if not cpus or workers < 1:
        raise ValueError(f"cannot split {len(cpus)} CPUs between {workers} workers")
    if len(cpus) < workers:
        note = (f"{len(cpus)} CPU{'s' if len(cpus) > 1 else ''} ({format_cpu_list(cpus)}) for {workers} workers: "
                f"workers share CPUs, one each in turn")
        return [(cpus[i % len(cpus)],) for i in range(workers)], note
    share, extra = divmod(len(cpus), workers)
    sets, start = [], 0
    for i in range(workers):
        n = share + (i < extra)
        sets.append(cpus[start:start + n])
        start += n
    return sets, None
