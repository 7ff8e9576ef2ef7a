"""Network namespaces for tests: two namespaces joined by a veth link that a test can cut.

    with NetnsPair(tag="x") as net:              # tests skip unless root with `ip netns` (``unavailable``)
        p = NetnsServer(net.a, net.addr_a, "--role", "prefill", ...).start()
        ...
        net.cut()                                # both ends of the link down
        net.restore()

- :class:`NetnsPair` creates namespaces ``sstf<pid>-<tag>a`` and ``...b`` (this process's pid, so
  concurrent test runs never share one; the tag sets apart pairs of one process), each with ``lo``
  up, and a veth pair
  between them with ``addr_a`` / ``addr_b`` (a /30 of 10.x addresses that exist only inside these
  namespaces). ``close()`` (also on ``with`` exit) deletes both namespaces, which deletes the veth
  pair; it runs whatever happened, and is idempotent. Namespaces left by a test process that died
  (its pid is gone) are removed when the next one starts. ``throttle(rate)`` shapes the traffic
  leaving ``a`` (``tc`` token bucket) so that a transfer takes seconds (``shaping_unavailable``).
- :class:`NetnsServer` is a :class:`conftest.ServerProcess` run inside a namespace (``ip netns
  exec``, which execs: the pid is the server's own, so ``kill -9`` kills the server), listening on
  that namespace's address.
- :func:`run_in` runs a function in a thread that entered a namespace (``setns``, which moves only
  the calling thread), so the test process can talk to servers the root namespace cannot reach:
  every socket the function opens lives in that namespace.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import requests

from conftest import REPO, ServerProcess, _die_with_parent, _live

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")
PREFIX = "sstf"  # splitserve test faults; names are <PREFIX><pid>-<tag><a|b>, interfaces v<pid><tag><a|b>


def unavailable() -> Optional[str]:
    """Why namespaces cannot be used here (None if they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def shaping_unavailable() -> Optional[str]:
    """Why :meth:`NetnsPair.throttle` cannot work here (None if it can): ``tc`` and the kernel's
    token bucket qdisc (``sch_tbf``), tried on a scratch pair."""
    why = unavailable()
    if why:
        return why
    if shutil.which("tc") is None:
        return "the `tc` command (iproute2) is not installed"
    with NetnsPair(tag="tc") as scratch:
        try:
            scratch.throttle("1mbit")
        except RuntimeError as exc:
            return f"traffic shaping (tc tbf) is not available: {exc}"
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _libc():
    return ctypes.CDLL("libc.so.6", use_errno=True)


def enter(ns: str) -> None:
    """Move the calling thread (only it) into network namespace ``ns``."""
    fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in(ns: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a new thread inside ``ns``; its result, or its exception raised here."""
    box: dict = {}

    def target() -> None:
        try:
            enter(ns)
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"in-{ns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces of ours whose test process is gone; their names."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\w*[ab])\b", line.strip())
        if m and not _pid_alive(int(m[2])):
            ip("netns", "del", m[1], check=False)
            removed.append(m[1])
    return removed


class NetnsPair:
    """Two namespaces joined by a veth link (see the module docstring)."""

    def __init__(self, tag: str = "", subnet: str = "10.77.0"):
        """``tag``: a few letters that set this pair apart from others of the same process."""
        pid = os.getpid()
        self.a, self.b = f"{PREFIX}{pid}-{tag}a", f"{PREFIX}{pid}-{tag}b"
        self.if_a, self.if_b = f"v{pid}{tag}a", f"v{pid}{tag}b"
        assert len(self.if_a) <= 15, "interface names are at most 15 characters"
        self.addr_a, self.addr_b = f"{subnet}.1", f"{subnet}.2"
        self._created: list[str] = []

    def open(self) -> "NetnsPair":
        remove_stale()
        try:
            for ns in (self.a, self.b):
                ip("netns", "add", ns)
                self._created.append(ns)
                ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "add", self.if_a, "netns", self.a, "type", "veth", "peer", "name", self.if_b, "netns", self.b)
            ip("-n", self.a, "addr", "add", f"{self.addr_a}/30", "dev", self.if_a)
            ip("-n", self.b, "addr", "add", f"{self.addr_b}/30", "dev", self.if_b)
            self.restore()
        except BaseException:
            self.close()
            raise
        return self

    def cut(self) -> None:
        """Both ends of the link down: nothing crosses, no connection is told (no reset)."""
        ip("-n", self.a, "link", "set", self.if_a, "down")
        ip("-n", self.b, "link", "set", self.if_b, "down")

    def throttle(self, rate: str) -> None:
        """Shape what leaves namespace ``a`` over the link to ``rate`` (``tc`` token bucket), so that
        a transfer takes seconds; :meth:`unthrottle` undoes it."""
        ip("netns", "exec", self.a, "tc", "qdisc", "replace", "dev", self.if_a, "root", "tbf", "rate", rate,
           "burst", "32kbit", "latency", "400ms")

    def unthrottle(self) -> None:
        ip("netns", "exec", self.a, "tc", "qdisc", "del", "dev", self.if_a, "root", check=False)

    def restore(self, timeout: float = 10.0) -> None:
        """Bring both ends up and wait for their carrier: a process that looks at its interfaces
        before then (UCX lists them when a worker is created) would not see the link at all."""
        ip("-n", self.a, "link", "set", self.if_a, "up")
        ip("-n", self.b, "link", "set", self.if_b, "up")
        deadline = time.monotonic() + timeout
        for ns, ifname in ((self.a, self.if_a), (self.b, self.if_b)):
            while "LOWER_UP" not in ip("-n", ns, "link", "show", ifname).stdout:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ifname} in {ns} has no carrier {timeout}s after the restore")
                time.sleep(0.01)

    def close(self) -> None:
        """Delete both namespaces (and with them the veth pair, which never lives in the root
        namespace: it is created inside them). Stop the servers in them first."""
        while self._created:
            ns = self._created.pop()
            ip("netns", "del", ns, check=False)

    def __enter__(self) -> "NetnsPair":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


class NetnsServer(ServerProcess):
    """``splitserve serve`` inside namespace ``ns``, listening on ``host`` (an address of ``ns``).
    ``get`` and ``post_generate`` talk to it from inside ``ns``."""

    trusted_prefill = "10.0.0.0/8"  # the namespaces' addresses (NetnsPair)

    def __init__(self, ns: str, host: str, *args: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.netns = ns
        self.host = host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _spawn(self, port: int) -> None:
        self.port = port
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, SPLITSERVE_CACHE=str(self.cache_dir), PYTHONUNBUFFERED="1", **self.extra_env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        cmd = ["ip", "netns", "exec", self.netns, sys.executable, "-m", "splitserve.cli", self.subcommand,
               "--model", self.model, "--host", self.host, "--port", str(port), *self.args]
        self._close_logs()
        self._out = open(self._logdir / "stdout.log", "wb")
        self._err = open(self._logdir / "stderr.log", "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._out, stderr=self._err,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        _live.add(self)

    def get(self, path: str, timeout: float = 10.0) -> requests.Response:
        return run_in(self.netns, requests.get, self.url + path, timeout=timeout)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        run_in(self.netns, super().wait_ready, timeout)

    def post_generate(self, *args, **kwargs) -> requests.Response:
        from cluster import post_generate

        return run_in(self.netns, post_generate, *args, **kwargs)

    def call(self, fn: Callable, *args, **kwargs):
        """``fn`` run inside this server's namespace (e.g. ``pages_back_to_total``)."""
        return run_in(self.netns, fn, *args, **kwargs)
