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


def test_commit_subjects_are_at_most_72_characters():
    known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{BASE}^{{commit}}"], capture_output=True)
    if known.returncode != 0:
        pytest.skip("not a git checkout holding the rule's base commit (a shallow clone, an archive)")
    log = subprocess.run(["git", "-C", str(REPO), "log", "--format=%h %s", f"{BASE}..HEAD"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    long = [line for line in log if len(line.split(" ", 1)[1]) > MAX_SUBJECT]
    assert not long, f"commit subjects over {MAX_SUBJECT} characters: {long}"
