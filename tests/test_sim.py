"""The cluster simulator (issue 9; ``docs/lifecycle.md``, *The simulator*): seeds keep every
invariant, a seed replays exactly in another process, and every planted bug is caught.

The figures (seeds, simulated requests and hours, faults by kind, wall time) are printed, never
asserted as timings. ``make check-long`` runs many more seeds (``test_many_seeds``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sim_plants import PLANTED, run_planted
from splitserve.sim.run import Totals, run_many, run_seed

EVERYDAY_SEEDS = 16  # x EVERYDAY_REQUESTS, two processes
EVERYDAY_REQUESTS = 300
PLANT_REQUESTS = 100  # per seed while looking for a planted bug
PLANT_SEEDS = 40  # the most seeds a planted bug may take
LONG_MINUTES = float(os.environ.get("SPLITSERVE_SIM_MINUTES", "60"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _show(capsys, lines) -> None:
    with capsys.disabled():
        print()
        for line in lines:
            print("  sim:", line)


def test_seeds_keep_every_invariant(capsys):
    """A small cluster (2 prefill + 2 decode and a router) per seed, quiet and chaos seeds, every
    invariant checked while they run; any failing seed is named with its replay command."""
    started = time.perf_counter()
    failures = []
    totals = run_many(range(EVERYDAY_SEEDS), EVERYDAY_REQUESTS, processes=2,
                      on_result=lambda r: failures.append(r) if not r.ok else None)
    _show(capsys, totals.report(time.perf_counter() - started))
    assert totals.seeds == EVERYDAY_SEEDS and totals.requests == EVERYDAY_SEEDS * EVERYDAY_REQUESTS
    assert sum(totals.faults.values()) > 0 and totals.endings["finished"] > 0
    assert not failures, "\n".join(f"seed {r.seed}: {r.violations[0]}\n  replay: python -m splitserve.sim --seed "
                                   f"{r.seed}" for r in failures)


def _sim(*args: str, code: str = "") -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "splitserve.sim", *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")})


def _without_wall(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("wall")]


def test_a_seed_replays_exactly_in_another_process():
    """Two processes, one seed: the same report, line for line, but the wall-clock line."""
    one, two = _sim("--seed", "7", "--requests", "80"), _sim("--seed", "7", "--requests", "80")
    assert one.returncode == 0 and two.returncode == 0, one.stdout + one.stderr
    assert "ok: every invariant held" in one.stdout
    assert _without_wall(one.stdout) == _without_wall(two.stdout)
    assert any(line.startswith("wall") for line in one.stdout.splitlines())


PLANTED_REPLAY = """
import sys
import pytest
from sim_plants import plant
from splitserve.sim.__main__ import main
mp = pytest.MonkeyPatch()
plant(mp, "health blind to a wedged loop")
sys.exit(main(sys.argv[1:]))
"""


def test_a_failing_seed_prints_its_trace_and_replays_it_exactly():
    """A violation: exit status 1, the violation, the trace of the events before it and the replay
    command — the same in two processes."""
    one = _sim("--seed", "2", "--requests", str(PLANT_REQUESTS), "--trace", "30", code=PLANTED_REPLAY)
    two = _sim("--seed", "2", "--requests", str(PLANT_REQUESTS), "--trace", "30", code=PLANTED_REPLAY)
    assert one.returncode == 1 and two.returncode == 1, one.stdout + one.stderr
    assert "VIOLATION" in one.stdout and "trace (the last" in one.stdout
    assert "replay: python -m splitserve.sim --seed 2" in one.stdout
    assert _without_wall(one.stdout) == _without_wall(two.stdout)


@pytest.fixture(scope="module")
def pool():
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        yield pool


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_is_caught(bug, pool, capsys):
    """Each planted bug (``sim_plants.py``) breaks an invariant within ``PLANT_SEEDS`` seeds
    (run two at a time; the first seed that caught it is reported)."""
    for first in range(0, PLANT_SEEDS, 2):
        runs = [pool.apply_async(run_planted, (bug, seed, PLANT_REQUESTS)) for seed in (first, first + 1)]
        caught = [(seed, violation) for seed, violation in (run.get(timeout=600) for run in runs) if violation]
        if caught:
            seed, violation = caught[0]
            _show(capsys, [f"{bug}: caught by seed {seed} ({seed + 1} seeds of {PLANT_REQUESTS} requests): "
                           f"{violation[:200]}"])
            return
    pytest.fail(f"{bug}: not caught in {PLANT_SEEDS} seeds")


# seeds that caught a real bug (tests/sim_plants.py, "found: ..."), kept as regression cases
FOUND = {"a write call that raises": 4, "a StartWrite hand-over that raises": 23,
         "a room answered in the page queue": 12}


@pytest.mark.parametrize("bug", FOUND)
def test_the_seed_that_found_a_real_bug_keeps_every_invariant(bug):
    seed = FOUND[bug]
    result = run_seed(seed, requests=PLANT_REQUESTS)
    assert result.ok, f"seed {seed}: {result.violations[0]}"


@pytest.mark.long
def test_many_seeds(capsys):
    """``make check-long``: seeds for ``SPLITSERVE_SIM_MINUTES`` (default 60) minutes."""
    started = time.perf_counter()
    totals, seed, failures = Totals(), 1000, []
    while time.perf_counter() - started < LONG_MINUTES * 60:
        totals.merge(run_many(range(seed, seed + 8), EVERYDAY_REQUESTS, processes=2,
                              on_result=lambda r: failures.append(r) if not r.ok else None))
        seed += 8
    _show(capsys, totals.report(time.perf_counter() - started))
    assert not failures, "\n".join(f"seed {r.seed}: {r.violations[0]}" for r in failures)
