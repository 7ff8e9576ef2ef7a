"""Commit subjects stay at most 72 characters (the rest of a message goes in its body): read from
the git history of the commits after ``BASE``, the last whose subjects were not held to it (the
history before is left as it landed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BASE = "42adfc213a7d5555b90caf2d30bc966631d36d58"
MAX_SUBJECT = 72
LANDED_LONG = {"3d7303c9b779445698e64a026987039f4886cb1e", "766c8002d602acaee467ba279de1f233c667eaeb"}
"""Commits after ``BASE`` that landed over the limit (two parallel commits): history is never
rewritten, so they are named here, each by its full hash; nothing else is excused."""


def test_commit_subjects_are_at_most_72_characters():
    known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{BASE}^{{commit}}"], capture_output=True)
    if known.returncode != 0:
        pytest.skip("not a git checkout holding the rule's base commit (a shallow clone, an archive)")
    log = subprocess.run(["git", "-C", str(REPO), "log", "--format=%H %s", f"{BASE}..HEAD"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    subjects = [line.split(" ", 1) for line in log]
    long = [f"{h[:7]} {s}" for h, s in subjects if len(s) > MAX_SUBJECT and h not in LANDED_LONG]
    assert not long, f"commit subjects over {MAX_SUBJECT} characters: {long}"
