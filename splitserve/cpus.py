"""CPU placement: which CPUs a worker process runs on and how many threads torch uses there.

A worker takes ``--cpus 0-3,6`` (its CPU affinity) and ``--threads N`` (torch intra-op threads);
unset, it keeps the CPUs it was started with and uses one thread per physical core among them
(SMT siblings, as the kernel lists them in ``topology/thread_siblings_list``, count once: torch's
own default is also one thread per physical core). :func:`place_process`
applies both once, at the start of ``splitserve serve``, before the engine, the event loop or
torch's thread pool exist: the affinity is set on every thread of the process (Linux affinity is
per thread, and a thread inherits its creator's), so every thread started later inherits it.

Two workers on one host that each spin one thread per core fight over every core (OpenMP threads
spin-wait, so an oversubscribed core wastes time on both). :func:`split_between_workers` gives each
worker of ``splitserve launch`` its own physical cores out of the CPUs launch may use (a core's SMT
siblings go to the same worker), an equal share each; with fewer cores than workers they share
cores (then CPUs, one each in turn), and the caller says so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

log = logging.getLogger(__name__)

SYSFS_CPU = "/sys/devices/system/cpu"


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


def cpu_cores(cpus: Sequence[int], sysfs: str = SYSFS_CPU) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (SMT siblings together, from the kernel's
    ``topology/thread_siblings_list``), ordered by their first CPU; a CPU whose topology cannot
    be read is a core of its own."""
    wanted, seen, cores = set(cpus), set(), []
    for cpu in sorted(wanted):
        if cpu in seen:
            continue
        try:
            with open(f"{sysfs}/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings = set(parse_cpu_list(f.read().strip()))
        except (OSError, ValueError):
            siblings = set()
        core = tuple(sorted((siblings & wanted) | {cpu}))
        seen.update(core)
        cores.append(core)
    return cores


def place_process(cpus: Optional[str] = None, threads: Optional[int] = None) -> Placement:
    """Pin this process to ``cpus`` (None: keep its CPUs) and give torch ``threads`` threads
    (None: one per physical core among them). Call it before the process starts threads of its own. ValueError for a
    bad list, CPUs outside the process's affinity, or ``threads`` < 1."""
    allowed = allowed_cpus()
    chosen = allowed if cpus is None else check_cpus(cpus, allowed)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads}: need at least 1")
    if cpus is not None:
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("--cpus: this platform has no CPU affinity (os.sched_setaffinity)")
        _set_affinity_of_every_thread(chosen)
    n = threads if threads is not None else len(cpu_cores(chosen))
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


def split_between_workers(cpus: Sequence[int], workers: int,
                          cores_of: Callable[[Sequence[int]], list[tuple[int, ...]]] = cpu_cores
                          ) -> tuple[list[tuple[int, ...]], Optional[str]]:
    """``workers`` CPU sets out of ``cpus``: disjoint runs of whole physical cores (``cores_of``
    groups CPUs by core), an equal share each (the first workers get one more when it does not
    divide). Fewer cores than workers: the CPUs are split instead, so SMT siblings are shared;
    fewer CPUs than workers: each gets one CPU, in turn. The second value says when workers share
    (else None)."""
    cpus = tuple(sorted(set(cpus)))
    if not cpus or workers < 1:
        raise ValueError(f"cannot split {len(cpus)} CPUs between {workers} workers")
    cores = cores_of(cpus)
    if len(cores) >= workers:
        return [tuple(sorted(c for core in group for c in core)) for group in _even_runs(cores, workers)], None
    if len(cpus) >= workers:
        flat = [c for core in cores for c in core]
        note = (f"{len(cores)} physical core{'s' * (len(cores) > 1)} ({format_cpu_list(cpus)}) for {workers} "
                f"workers: workers share cores (SMT siblings)")
        return [tuple(sorted(group)) for group in _even_runs(flat, workers)], note
    note = (f"{len(cpus)} CPU{'s' * (len(cpus) > 1)} ({format_cpu_list(cpus)}) for {workers} workers: "
            f"workers share CPUs, one each in turn")
    return [(cpus[i % len(cpus)],) for i in range(workers)], note


def _even_runs(items: Sequence, n: int) -> list[Sequence]:
    """``items`` cut into ``n`` consecutive runs whose lengths differ by at most one (longer first)."""
    share, extra = divmod(len(items), n)
    runs, start = [], 0
    for i in range(n):
        size = share + (i < extra)
        runs.append(items[start:start + size])
        start += size
    return runs
