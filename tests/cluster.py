"""A disaggregated cluster as real processes, for integration tests: N prefill workers, M decode
workers and a router in front, each on free loopback ports.

    with Cluster(prefill=1, decode=1, backend="nixl") as c:
        ids = generate(c.url, [10, 11, 12], max_new_tokens=8)
        for w in c.workers:
            pages_back_to_total(w)

- Every worker is a :class:`conftest.ServerProcess` (``serve --model tiny --role prefill|decode``);
  prefill workers also get a free ``--bootstrap-port`` (kept as ``worker.bootstrap_port``).
- The workers are all spawned first and then waited for, so they load in parallel; the router is
  started once they answer ``/health`` (its first round of health checks then finds them up).
  Processes are spawned from the calling thread, never a pool thread: ``PR_SET_PDEATHSIG`` is tied
  to the thread that forks, so a child forked from a pool thread dies with that thread.
- A port taken between our probe and the child's bind (``cannot listen`` / ``Address already in
  use``) makes that one worker start again on new ports, up to three times.
- ``stop()`` always stops everything (router first, then the workers), and is idempotent; a failed
  ``start()`` stops what it started before raising. ``output()`` gathers every process's log tail
  for failure messages.

Helpers: :func:`generate` (``/generate``, plain or streamed, output ids back), :func:`post_generate`
(the raw response, for error tests), :func:`metrics` and :func:`pages_back_to_total` (poll a
worker's ``/metrics`` until its KV pages are all free and its live lifecycle queues are empty).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

import requests

from conftest import REPO, STARTUP_TIMEOUT_S, ServerProcess, free_port, log_dir
from helpers.sse import sse_events
from helpers.waiting import wait_for
from splitserve.auth import bearer
from splitserve.metrics import parse_exposition

PORT_TAKEN = ("cannot listen", "Address already in use", "address already in use")
HTTP_TIMEOUT_S = 120.0


class RouterProcess:
    """``splitserve router`` on a free port; ``start()`` returns once it listens (its ready line, or
    the line that says it is not ready yet) and, with ``wait_healthy`` (the default), ``/health``
    answers 200 (a prefill and a decode worker are up). ``wait_healthy=False`` is for tests of a
    router whose workers are down or fake. It splits every request (``--pd-threshold-tokens 0``)
    unless ``args`` say otherwise: the split is what most tests are about, with short prompts."""

    def __init__(self, prefill: Sequence[tuple[str, int]], decode: Sequence[str], *args: str,
                 startup_timeout: float = STARTUP_TIMEOUT_S, wait_healthy: bool = True, tls: Optional[dict] = None):
        self.argv: list[str] = []
        for url, bootstrap in prefill:
            self.argv += ["--prefill", url, str(bootstrap)]
        for url in decode:
            self.argv += ["--decode", url]
        self.argv += list(args)
        if not any(a.split("=")[0] == "--pd-threshold-tokens" for a in args):
            self.argv += ["--pd-threshold-tokens", "0"]  # split every request: the path most tests are about
        self.startup_timeout = startup_timeout
        self.wait_healthy = wait_healthy
        self.tls = tls  # a TLS router: requests' keywords to reach it
        self.logdir = log_dir("router-")
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> "RouterProcess":
        start_routers(self)
        return self

    def _spawn(self) -> None:
        from conftest import _die_with_parent

        self.port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.logdir / "out.log", "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.cli", "router", "--host", "127.0.0.1",
                 "--port", str(self.port), *self.argv],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def _wait(self, last_attempt: bool) -> bool:
        """True once it listens (and is healthy, if asked); False if its port was taken (to be
        spawned again), unless ``last_attempt``; raises with its output otherwise."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            listening = any(line in self.output() for line in ("splitserve router ready",
                                                               "splitserve router listening"))
            if listening and (not self.wait_healthy or self._healthy()):
                return True
            time.sleep(0.1)
        self.stop()
        if not any(s in self.output() for s in PORT_TAKEN) or last_attempt:
            raise RuntimeError(f"the router did not start:\n{self.output()}")
        return False

    def _healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2, **(self.tls or {})).status_code == 200
        except requests.RequestException:
            return False

    def output(self) -> str:
        path = self.logdir / "out.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def output_tail(self, chars: int = 4000) -> str:
        return f"--- router on port {self.port} ---\n{self.output()[-chars:]}"

    def metrics(self) -> dict:
        return metrics(self)

    def metric(self, name: str, **labels) -> float:
        return metric(self.metrics(), name, **labels)

    def stop(self) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_routers(*routers: RouterProcess) -> list[RouterProcess]:
    """Start ``routers`` side by side (each loads in its own process: on two cores two load at once)
    and return them once each listens as ``RouterProcess.start`` says; one whose port was taken
    between our probe and its bind starts again on another, up to three times. On a failure the
    caller stops them (each is safe to stop, started or not)."""
    pending = list(routers)
    for attempt in range(3):
        for router in pending:
            router._spawn()
        pending = [router for router in pending if not router._wait(last_attempt=attempt == 2)]
        if not pending:
            return list(routers)
    raise AssertionError("unreachable")


def stop_routers(*routers: RouterProcess) -> None:
    """Stop ``routers`` side by side: each signalled first, so that they drain together (each is
    safe to stop, started or not)."""
    for router in routers:
        if router.proc is not None and router.proc.poll() is None:
            router.proc.send_signal(signal.SIGTERM)
    for router in routers:
        router.stop()


class Cluster:
    """``prefill`` prefill workers and ``decode`` decode workers of ``model`` (default the tiny
    model) over ``backend`` (``nixl`` or ``tcp``), and a router in front (``router=False``: none).
    Extra command-line options: ``worker_args`` for every worker, ``prefill_args`` /
    ``decode_args`` per role (a list of option lists, one per worker, to set them apart),
    ``router_args`` for the router; ``worker_tls`` / ``router_tls``: for TLS servers, the ``requests``
    keywords that reach them (``verify``, ``cert``)."""

    def __init__(self, prefill: int = 1, decode: int = 1, backend: str = "nixl", *,
                 worker_args: Sequence[str] = (), prefill_args=(), decode_args=(),
                 router_args: Sequence[str] = (), router: bool = True,
                 startup_timeout: float = STARTUP_TIMEOUT_S, model: str = "tiny",
                 worker_tls: Optional[dict] = None, router_tls: Optional[dict] = None):
        self.n_prefill, self.n_decode = prefill, decode
        self.model = model
        self.backend = backend
        self.worker_args = list(worker_args)
        self.prefill_args = _per_worker(prefill_args, prefill)
        self.decode_args = _per_worker(decode_args, decode)
        self.router_args = list(router_args)
        self.with_router = router
        self.worker_tls, self.router_tls = worker_tls, router_tls  # TLS servers: requests' keywords to reach them
        self.startup_timeout = startup_timeout
        self.prefill: list[ServerProcess] = []
        self.decode: list[ServerProcess] = []
        self.router: Optional[RouterProcess] = None

    # -- start and stop ------------------------------------------------------------------------

    @property
    def workers(self) -> list[ServerProcess]:
        return self.prefill + self.decode

    @property
    def url(self) -> str:
        """The router's URL."""
        if self.router is None:
            raise RuntimeError("this cluster has no router")
        return self.router.url

    def start(self) -> "Cluster":
        started = time.monotonic()
        try:
            self.prefill = [self._spawn("prefill", i) for i in range(self.n_prefill)]
            self.decode = [self._spawn("decode", i) for i in range(self.n_decode)]
            for role, procs in (("prefill", self.prefill), ("decode", self.decode)):
                for i in range(len(procs)):
                    procs[i] = self._wait(procs[i], role, i, started)
            if self.with_router:
                self.router = RouterProcess([(p.url, p.bootstrap_port) for p in self.prefill],
                                            [d.url for d in self.decode], *self.router_args,
                                            tls=self.router_tls).start()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, role: str, index: int) -> ServerProcess:
        extra = self.prefill_args[index] if role == "prefill" else self.decode_args[index]
        args = ["--role", role, "--transfer-backend", self.backend, *self.worker_args, *extra]
        bootstrap = None
        if role == "prefill":
            bootstrap = free_port()
            args += ["--bootstrap-port", str(bootstrap)]
        proc = ServerProcess(*args, model=self.model, startup_timeout=self.startup_timeout, tls=self.worker_tls)
        proc.role, proc.bootstrap_port = role, bootstrap
        proc._spawn(free_port())
        return proc

    def _wait(self, proc: ServerProcess, role: str, index: int, started: float) -> ServerProcess:
        for attempt in range(3):
            try:
                proc.wait_ready(max(1.0, self.startup_timeout - (time.monotonic() - started)))
                return proc
            except RuntimeError as exc:
                proc.stop(timeout=5)
                if attempt == 2 or not any(s in str(exc) for s in PORT_TAKEN):
                    raise RuntimeError(f"{role} worker {index} did not start: {exc}") from None
                proc = self._spawn(role, index)
        raise AssertionError("unreachable")

    def wait_in_rotation(self, timeout: float = 120.0) -> None:
        """Wait until the router holds every worker healthy. Its ``/health`` is 200 once one pair
        is, and a first health check that a busy machine answered late leaves a worker out until
        the next round: a test that counts on round robin's order waits for this first."""
        want = {w.url for w in self.workers}
        wait_for("every worker in the router's rotation", lambda: want <= {
            w["url"] for w in requests.get(self.url + "/workers", timeout=10).json()["workers"] if w["healthy"]},
            timeout, interval=0.1, on_fail=self.output)

    def stop(self) -> None:
        """Stop the router, then every worker (SIGTERM, then SIGKILL). Safe to call again."""
        if self.router is not None:
            self.router.stop()
        for proc in self.workers:  # signalled together, so they drain together
            if proc.proc is not None and proc.proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            proc.stop(timeout=15)

    def __enter__(self) -> "Cluster":
        return self if self.workers else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- looking at it -------------------------------------------------------------------------

    def output(self, chars: int = 3000) -> str:
        """The tail of every process's log, for assertion messages."""
        parts = [p.output_tail(chars) for p in self.workers]
        if self.router is not None:
            parts.append(self.router.output_tail(chars))
        return "\n".join(parts)

    def assert_no_leaks(self, timeout: float = 20.0) -> None:
        for w in self.workers:
            pages_back_to_total(w, timeout)


def _per_worker(args, n: int) -> list[list[str]]:
    """``args``: options for every worker of the role (a flat list of strings), or one list each."""
    args = list(args)
    if args and not isinstance(args[0], str):
        if len(args) != n:
            raise ValueError(f"{len(args)} option lists for {n} workers")
        return [list(a) for a in args]
    return [list(args) for _ in range(n)]


# -- requests --------------------------------------------------------------------------------------


def post_generate(url: str, ids: Sequence[int], max_new_tokens: int, stream: bool = False,
                  timeout: float = HTTP_TIMEOUT_S, extra: Optional[dict] = None, **sampling) -> requests.Response:
    """POST ``/generate`` and return the response (streams are read to the end: ``.text`` holds the
    whole SSE body). ``extra``: more top-level fields (``bootstrap_room`` ...)."""
    body = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": max_new_tokens, **sampling},
            **({"stream": True} if stream else {}), **(extra or {})}
    return requests.post(url.rstrip("/") + "/generate", json=body, timeout=timeout)


def generate(url: str, ids: Sequence[int], max_new_tokens: int, stream: bool = False, *,
             timeout: float = HTTP_TIMEOUT_S, **sampling) -> list[int]:
    """The output ids of one ``/generate`` request (``sampling``: more ``sampling_params``). With
    ``stream``, every SSE chunk carries the whole answer so far: the last one is the answer, and
    the stream must end with ``[DONE]``. Raises AssertionError on any error."""
    resp = post_generate(url, ids, max_new_tokens, stream, timeout, **sampling)
    assert resp.status_code == 200, f"/generate answered {resp.status_code}: {resp.text[:2000]}"
    if not stream:
        return list(resp.json()["output_ids"])
    events = sse_events(resp.text)
    assert events and events[-1] == "[DONE]", f"the stream did not end with [DONE]: {resp.text[-2000:]}"
    chunks = events[:-1]
    errors = [e for e in chunks if "error" in e]
    assert not errors, f"the stream carried an error: {errors}"
    assert chunks, "the stream carried no answer"
    return list(chunks[-1]["output_ids"])


# -- metrics ---------------------------------------------------------------------------------------


def metrics(worker, api_key: str = "") -> dict:
    """A worker's ``/metrics`` as ``{(name, frozenset(labels)): value}``; ``worker``: anything with
    ``url``, or a URL; ``api_key``: a key that opens its ``/metrics``, if it is keyed."""
    url = worker if isinstance(worker, str) else worker.url
    r = requests.get(url.rstrip("/") + "/metrics", timeout=10, headers=bearer(api_key) if api_key else {})
    r.raise_for_status()
    return parse_exposition(r.text)


def metric(samples: dict, name: str, **labels) -> float:
    """One sample (0 if absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def metric_sum(samples: dict, name: str, **labels) -> float:
    """The sum of a metric over every label set that includes ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def live_queues(samples: dict) -> dict[str, float]:
    """``splitserve_queue_requests`` for the lifecycle's live states (upper-case queue names)."""
    out = {}
    for (name, labels), value in samples.items():
        queue = dict(labels).get("queue", "")
        if name == "splitserve_queue_requests" and queue.isupper():
            out[queue] = value
    return out


def pages_back_to_total(worker, timeout: float = 20.0, api_key: str = "") -> dict:
    """Flush ``worker``'s prefix cache and poll its ``/metrics`` until ``splitserve_kv_pages_free``
    equals ``splitserve_kv_pages_total`` (nothing owned, quarantined or cached) and every live
    lifecycle queue gauge is 0; the last samples. Raises AssertionError with what was seen (and the
    worker's log tail) after ``timeout``. ``api_key``: one that opens the worker's ``/flush_cache``
    and ``/metrics`` (its admin key, or the router's)."""
    deadline = time.monotonic() + timeout
    seen = "nothing"
    url = worker if isinstance(worker, str) else worker.url
    while True:
        try:
            requests.post(url.rstrip("/") + "/flush_cache", timeout=10,
                          headers=bearer(api_key) if api_key else {}).raise_for_status()
            samples = metrics(worker, api_key)
            free = samples.get(("splitserve_kv_pages_free", frozenset()))
            total = samples.get(("splitserve_kv_pages_total", frozenset()))
            queues = live_queues(samples)
            if free is not None and free == total and not any(queues.values()):
                return samples
            seen = f"free={free} total={total} queues={queues}"
        except requests.RequestException as exc:
            seen = f"/metrics failed: {exc}"
        if time.monotonic() >= deadline:
            tail = worker.output_tail(3000) if hasattr(worker, "output_tail") else ""
            raise AssertionError(f"{url}: KV pages not all free after {timeout:g}s: {seen}\n{tail}")
        time.sleep(0.1)
