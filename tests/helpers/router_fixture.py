"""``start_router``: router processes for a test, stopped after it."""

from __future__ import annotations

import pytest

from cluster import RouterProcess, start_routers


@pytest.fixture
def start_router():
    """``start_router(prefill, decode, *args)``: a router, stopped after the test;
    ``start_router.together((prefill, decode, *args), ...)``: several, started side by side."""
    started: list[RouterProcess] = []

    def start(prefill, decode, *args: str) -> RouterProcess:
        router = RouterProcess(prefill, decode, *args, wait_healthy=False)
        started.append(router)
        return router.start()

    def together(*specs) -> list[RouterProcess]:
        routers = [RouterProcess(*spec, wait_healthy=False) for spec in specs]
        started.extend(routers)
        return start_routers(*routers)

    start.together = together
    yield start
    for router in started:
        router.stop()
