"""The worker's metric tables (``server/worker_metrics.py``) against ``docs/metrics.md``: every
metric the tables make is in the docs' table with its type and labels, and the lifecycle states
the docs name for each role are the transition table's (``disagg/lifecycle/transitions.py``), so
a state added there cannot go missing here. No server runs: the tables are data."""

from __future__ import annotations

import re
from pathlib import Path

from splitserve.disagg.lifecycle.states import Role
from splitserve.disagg.lifecycle.transitions import BY_ROLE, Waits
from splitserve.server.worker_metrics import DERIVED, RECORDED

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
ROW = re.compile(r"\| `(splitserve_\w+)` \| (\w+) \|([^|]*)\|[^|]*\|(.*)\|\s*$")


def rows() -> dict[str, tuple[str, set, str]]:
    """The docs' table: name -> (type, label names, what it says)."""
    out = {}
    for line in DOCS.read_text().splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(1)] = (m.group(2), {x.strip() for x in m.group(3).split(",") if x.strip()}, m.group(4))
    return out


def named_states(text: str) -> dict[str, list[str]]:
    """``P`` and ``D`` -> the states a row's text names for that role (in backticks, in order)."""
    out = {}
    for part in re.split(r";", text):
        m = re.search(r"(?:^|\()\s*([PD])\b", part)
        if m:
            out[m.group(1)] = re.findall(r"`([A-Z_]+)`", part[m.end():])
    return out


def expected(kinds) -> dict[str, list[str]]:
    """``P`` and ``D`` -> the live states that wait for ``kinds`` (None: every live state; (): the running ones)."""
    out = {}
    for role, letter in ((Role.PREFILL, "P"), (Role.DECODE, "D")):
        table = BY_ROLE[role]
        chosen = (set(table.live_states()) if kinds is None else
                  table.waiting(*kinds) if kinds else set(table.live_states()) - table.waiting())
        out[letter] = [s.value for s in table.live_states() if s in chosen]
    return out


def test_every_metric_of_the_tables_is_in_the_docs_with_its_type_and_labels():
    docs = rows()
    for spec in DERIVED + RECORDED:
        kind = {"batch_histogram": "histogram"}.get(spec.kind, spec.kind)
        assert spec.name in docs, f"{spec.name} is made by the worker but not in docs/metrics.md"
        assert docs[spec.name][:2] == (kind, set(spec.labels)), f"{spec.name}: docs say {docs[spec.name][:2]}"


def test_the_states_the_docs_name_per_role_are_the_transition_tables():
    docs = rows()
    for name, kinds in (("splitserve_queue_requests", None), ("splitserve_requests_running", ()),
                        ("splitserve_requests_waiting", (Waits.QUEUE, Waits.PEER)),
                        ("splitserve_queue_time_seconds", (Waits.QUEUE,))):
        assert named_states(docs[name][2]) == expected(kinds), f"{name}: the states named differ"


def test_the_help_texts_name_the_transition_tables_states():
    helps = {spec.name: spec.help for spec in DERIVED + RECORDED}
    for name, kinds in (("splitserve_requests_running", ()), ("splitserve_requests_waiting", (Waits.QUEUE, Waits.PEER)),
                        ("splitserve_queue_time_seconds", (Waits.QUEUE,))):
        for letter, role in (("P", "prefill"), ("D", "decode")):
            states = expected(kinds)[letter]
            said = re.search(rf"{role}: ([A-Z_, and]+)", helps[name]).group(1)
            assert re.findall(r"[A-Z_]{2,}", said) == states, f"{name}'s help for {role}: {said}"
