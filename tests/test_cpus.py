"""CPU placement (``splitserve/cpus.py``): CPU lists parsed and printed, the split between
workers, and ``place_process`` in a real process (every thread pinned, also one started before
it ran; torch's thread count), and ``serve`` refusing a bad ``--cpus`` with a clear error.
What ``launch`` gives its workers is in ``test_launch.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from splitserve.cpus import check_cpus, cpu_cores, format_cpu_list, parse_cpu_list, place_process, split_between_workers

ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("text, cpus", [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)), ("6,0-1,1", (0, 1, 6)),
                                        (" 2 - 3 ", (2, 3))])
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text, words", [("", "not a CPU number"), ("x", "not a CPU number"), ("1-", "not a CPU"),
                                         ("3-1", "not a valid range"), ("-1", "not a CPU number"),
                                         ("0,,1", "not a CPU number")])
def test_parse_cpu_list_errors_name_the_option_and_the_part(text, words):
    with pytest.raises(ValueError, match=words) as info:
        parse_cpu_list(text, "--decode-cpus")
    assert str(info.value).startswith(f"--decode-cpus {text!r}")


def test_format_cpu_list():
    assert format_cpu_list((6, 0, 1, 2, 3)) == "0-3,6"
    assert format_cpu_list([5]) == "5"
    assert format_cpu_list([0, 2, 4, 5]) == "0,2,4-5"
    for text in ("0-3,6", "1", "0,2-9,11"):
        assert format_cpu_list(parse_cpu_list(text)) == text


def test_check_cpus_names_what_is_not_allowed():
    assert check_cpus("1-2", [0, 1, 2, 3]) == (1, 2)
    with pytest.raises(ValueError, match=r"--cpus 0-5: CPUs 4-5 are not available to this process "
                                         r"\(it may run on 0-3\)"):
        check_cpus("0-5", [0, 1, 2, 3])


@pytest.mark.parametrize("cpus, workers, want", [
    ((0, 1), 2, [(0,), (1,)]),
    (tuple(range(8)), 3, [(0, 1, 2), (3, 4, 5), (6, 7)]),
    ((0, 2, 4, 6), 2, [(0, 2), (4, 6)]),
    (tuple(range(4)), 1, [(0, 1, 2, 3)]),
])
def test_split_between_workers_is_disjoint_and_covers(cpus, workers, want):
    sets, note = split_between_workers(cpus, workers)
    assert sets == want and note is None


def smt_pairs(cpus):
    """A 4-core, 8-CPU host numbered as Linux often does: CPU i and i+4 are one core's siblings."""
    return sorted({tuple(sorted({c % 4, c % 4 + 4} & set(cpus))) for c in cpus})


def test_cpu_cores_groups_smt_siblings_from_sysfs(tmp_path):
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3", 4: "4"}.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    assert cpu_cores([0, 1, 2, 3, 4], str(tmp_path)) == [(0, 2), (1, 3), (4,)]
    assert cpu_cores([1, 2], str(tmp_path)) == [(1,), (2,)]  # siblings outside the set are not counted
    assert cpu_cores([5], str(tmp_path)) == [(5,)]  # no topology: a core of its own


def test_split_keeps_smt_siblings_on_one_worker():
    sets, note = split_between_workers(range(8), 2, smt_pairs)
    assert sets == [(0, 1, 4, 5), (2, 3, 6, 7)] and note is None
    sets, note = split_between_workers((0, 1, 4, 5), 3, smt_pairs)  # 2 cores, 4 CPUs, 3 workers
    assert sets == [(0, 4), (1,), (5,)] and "2 physical cores" in note and "share cores" in note


def test_split_with_fewer_cpus_than_workers_shares_and_says_so():
    sets, note = split_between_workers((0, 1), 3)
    assert sets == [(0,), (1,), (0,)]
    assert "2 CPUs (0-1) for 3 workers" in note and "share" in note


PLACE = """
import json, os, sys, threading
from splitserve.cpus import current_placement, place_process
release = threading.Event()
early = threading.Thread(target=release.wait, daemon=True)
early.start()  # a thread that exists before the placement, alive until the end
p = place_process(sys.argv[1], int(sys.argv[2]))
seen = {}
late = threading.Thread(target=lambda: seen.update(threads=current_placement().threads))
late.start(); late.join()
tasks = {t: open(f"/proc/self/task/{t}/status").read().split("Cpus_allowed_list:")[1].split()[0]
         for t in os.listdir("/proc/self/task")}
release.set()
print(json.dumps({"cpus": p.cpus, "threads": p.threads, "late_thread_sees": seen["threads"], "tasks": tasks,
                  "early": early.native_id}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity through /proc is Linux only")
def test_place_process_pins_every_thread_and_sets_torch_threads():
    cpu = ALLOWED[-1]
    out = subprocess.run([sys.executable, "-c", PLACE, str(cpu), "1"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["cpus"] == [cpu] and got["threads"] == 1
    assert got["late_thread_sees"] == 1  # torch's count holds in threads started later (the engine loop)
    assert str(got["early"]) in got["tasks"] and set(got["tasks"].values()) == {str(cpu)}, got["tasks"]


def test_place_process_refuses_zero_threads_before_changing_anything():
    with pytest.raises(ValueError, match="--threads 0: need at least 1"):
        place_process(None, 0)


def test_serve_refuses_a_bad_cpu_list_before_loading_anything():
    outside = max(ALLOWED) + 1
    for args, words in ((["--cpus", f"0,{outside}"], f"CPU {outside} is not available to this process"),
                        (["--cpus", "two"], "'two' is not a CPU number")):
        out = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--port", "1", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        assert f"splitserve serve: {args[0]}" in out.stderr and words in out.stderr, out.stderr
