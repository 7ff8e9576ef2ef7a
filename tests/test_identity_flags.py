"""A worker's ``--worker-id`` and ``--advertise-host`` given empty are mistakes named at start
(exit 2, one line, before the model loads), never read as left out; and a router or worker
configured in code with ``discovery=""`` is refused, not run without discovery."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve.config import RouterConfig


def serve(*args: str) -> subprocess.CompletedProcess:
    # refused before the model loads; the timeout only stops a hang
    return subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", "tiny", "--port", "1", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flag, said", [("--worker-id", "a worker id is"), ("--advertise-host", "empty")])
def test_an_empty_identity_flag_exits_2_naming_it(flag, said):
    result = serve(flag, "")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-2000:])
    assert flag in lines[0] and said in lines[0], lines[0]


def test_a_router_configured_with_an_empty_discovery_is_refused():
    from splitserve.router.app import create_app

    with pytest.raises(ValueError, match="empty"):
        create_app(RouterConfig(discovery=""))
