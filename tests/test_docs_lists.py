"""Lists in the docs that are facts about the code, checked against the code: a list written by
hand drifts (a package, a state, a flag added without its line). Each test reads the doc and
derives the list from the tree; no server runs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def layout_block() -> str:
    """The README's *Layout* section's code block."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Layout"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def test_the_readme_layout_names_every_package():
    packages = sorted(p.parent.name for p in (REPO / "splitserve").glob("*/__init__.py"))
    named = set(re.findall(r"^\s+(\w+)/\s", layout_block(), re.M))
    missing = [p for p in packages if p not in named]
    assert not missing, f"README.md's Layout does not name these packages of splitserve/: {missing}"
