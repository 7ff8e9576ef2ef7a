"""What a worker shows of itself after a test: its live rooms, and that it is clean."""

from __future__ import annotations

import json

import requests

from cluster import metric, pages_back_to_total
from helpers.waiting import wait_for


def get_json(worker, path: str):
    """GET ``path`` from ``worker`` (a :class:`netns.NetnsServer` is asked from inside its namespace)."""
    if hasattr(worker, "netns"):
        return worker.get(path).json()
    return requests.get(worker.url + path, timeout=10).json()


def debug_rows(worker) -> list[dict]:
    return get_json(worker, "/debug/requests")


def assert_clean(worker, timeout: float = 20.0) -> dict:
    """Live gauges 0, every page free, none quarantined, ``/debug/requests`` empty."""
    if hasattr(worker, "netns"):
        samples = worker.call(pages_back_to_total, worker, timeout)
    else:
        samples = pages_back_to_total(worker, timeout)
    assert metric(samples, "splitserve_kv_pages_quarantined") == 0, samples
    wait_for("/debug/requests empty", lambda: debug_rows(worker) == [], 5.0,
             on_fail=lambda: json.dumps(debug_rows(worker)))
    return samples
