"""``wait_for``: poll until a condition holds, or fail naming it."""

from __future__ import annotations

import time
from typing import Callable, Optional

import requests


def wait_for(what: str, check: Callable[[], object], timeout: float = 60.0, interval: float = 0.05,
             on_fail: Optional[Callable[[], str]] = None):
    """Poll ``check`` until it returns something truthy, and return that; AssertionError naming
    ``what`` (and ``on_fail()``'s text, if given) after ``timeout`` seconds. A
    ``requests.RequestException`` or ``OSError`` from ``check`` counts as not yet: a worker may be
    starting or restarting."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except (requests.RequestException, OSError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            extra = on_fail() if on_fail is not None else ""
            raise AssertionError(f"{what}: not after {timeout:g}s (last: {last!r})\n{extra}")
        time.sleep(interval)
