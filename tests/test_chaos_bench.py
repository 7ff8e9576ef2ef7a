"""``bench/chaos.py``'s dry run: the request set mixes every kind the bench promises, the fault
schedule strikes every ``--every-s`` within ``--duration-s``, and nothing is started."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_dry_run_prints_the_request_mix_and_the_faults_and_starts_nothing():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "chaos.py"), "--dry-run", "--duration-s", "60",
                          "--every-s", "15"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("chaos: model tiny, 2 prefill + 2 decode") and "CPU flags:" in lines[0]
    mix = next(line for line in lines if line.startswith("requests: "))
    for kind in ("/v1/completions stream greedy", "/v1/completions whole seeded",
                 "/v1/chat/completions stream seeded", "/v1/chat/completions whole greedy"):
        assert kind in mix, mix
    faults = next(line for line in lines if line.startswith("faults: "))
    assert [part.split()[0] for part in faults[len("faults: "):].split(", ")] == ["t=15s", "t=30s", "t=45s"]
    assert "logs:" not in out.stdout  # nothing was started
