"""A real ``etcd`` (Debian's ``etcd-server``, 3.4) for tests: its own free client and peer ports on
loopback and a temporary data dir, so it never meets a daemon the package may have started.

    with EtcdServer() as etcd:
        ... --discovery etcd.url("/prefix") ...
        etcd.stop(); etcd.start()   # the same ports and data: an outage, then back
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import pytest
import requests

from conftest import free_port, log_dir


def have_etcd() -> bool:
    return shutil.which("etcd") is not None


def own_etcd():
    """A module fixture's body: an etcd of the module's own, or a skip where none is installed (a
    failure under CI, which installs it)."""
    if not have_etcd():
        message = "etcd is not installed (apt-get install etcd-server; .ci/run does)"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    with EtcdServer() as server:
        yield server


class EtcdServer:
    def __init__(self):
        self.client_port, self.peer_port = free_port(), free_port()
        self.data = tempfile.mkdtemp(prefix="etcd-data-")
        self.logdir = log_dir("etcd-")
        self.proc: Optional[subprocess.Popen] = None

    def url(self, prefix: str = "/splitserve") -> str:
        return f"etcd://127.0.0.1:{self.client_port}{prefix}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 60.0) -> "EtcdServer":
        from conftest import _die_with_parent

        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        with open(self.logdir / "out.log", "ab") as out:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "test", "--data-dir", self.data, "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer, "--initial-cluster", f"test={peer}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if requests.get(self.http + "/health", timeout=2).json().get("health") == "true":
                    return self
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"etcd not healthy after {timeout:g} s:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def output(self) -> str:
        path = self.logdir / "out.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self):
        from etcd3gw.client import Etcd3Client

        return Etcd3Client(host="127.0.0.1", port=self.client_port, api_path="/v3/", timeout=5)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)
