"""Shared test fixtures: real server processes and a small byte-level tokenizer.

``ServerProcess`` runs ``python -m splitserve.cli serve --model tiny --port <free port> ...`` as a
subprocess, with ``SPLITSERVE_CACHE`` pointed at ``CACHE_DIR``: the caller's ``$SPLITSERVE_CACHE``
if set (``.ci/run`` sets a fresh one), else ``<repo>/.cache/tests`` (gitignored), so models are
built or converted once for the whole session. Its stdout and stderr go to files (never a pipe
that could fill and block the server) in one folder per test run (``LOGS``: removed after a
passing run, kept and named after a failing one or with ``SPLITSERVE_KEEP_LOGS=1``), and every
failure message carries their tail. It is always stopped: by the fixture's teardown, by
``with``, at interpreter exit, and by a parent-death signal if the test process itself is killed.

Fixtures:

- ``server``: one shared colocated server for the session (tests must leave it as they found it:
  no requests left running).
- ``start_server``: a factory for extra servers with their own options
  (``start_server("--max-waiting-requests", "1")``), stopped at the end of the test.
- ``byte_tokenizer``: a tokenizer with one token per byte and a chat template, for tests that need
  tokenization but no model.

Elsewhere: ``from conftest import ServerProcess`` works because pytest puts ``tests/`` on the path.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest
import requests

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("SPLITSERVE_CACHE") or REPO / ".cache" / "tests")
# compiled CPU kernels off (the PyTorch reference ops) except where a test turns them on:
# tests/test_kernels.py; `SPLITSERVE_KERNELS=1 make test` runs everything with them
os.environ.setdefault("SPLITSERVE_KERNELS", "0")
# no shared weights file (models/packed_file.py) except where a test turns it on: every engine a test
# starts would write one per model and dtype into the run's cache (GBs for the SmolLM2 tests)
os.environ.setdefault("SPLITSERVE_SHARED_WEIGHTS", "0")
STARTUP_TIMEOUT_S = 180.0  # first run builds the tiny model; later runs take seconds

_live: set["ServerProcess"] = set()
# Every process's logs; removed after a passing run. One folder for the whole run: test processes
# of `pytest -n` (pytest-xdist) inherit it from the process that starts them, which alone reports
# (and removes) it.
_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ  # a test process of `pytest -n` (pytest-xdist sets it)
LOGS = Path(os.environ["SPLITSERVE_TEST_LOGS"] if _XDIST_WORKER else tempfile.mkdtemp(prefix="splitserve-tests-"))
os.environ["SPLITSERVE_TEST_LOGS"] = str(LOGS)


def log_dir(prefix: str) -> Path:
    """A fresh folder for one process's logs, under ``LOGS``."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=LOGS))


def pytest_terminal_summary(terminalreporter, exitstatus) -> None:
    """The logs go with a passing run; a failing one keeps them and says where. Only the process
    that started the run does either: a test process of ``pytest -n`` ends while others still
    write there."""
    if _XDIST_WORKER:
        return
    if exitstatus == 0 and not os.environ.get("SPLITSERVE_KEEP_LOGS"):
        shutil.rmtree(LOGS, ignore_errors=True)
    else:
        terminalreporter.write_line(f"server and router logs of this run: {LOGS}")


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_live):
        proc.stop(timeout=5)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it if the test process dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def role_of(args: list[str]) -> str:
    return args[args.index("--role") + 1] if "--role" in args[:-1] else "colocated"


def write_cluster_secret(path) -> str:
    """A fresh cluster secret in a new file ``path`` as an operator makes one (32 random bytes,
    hex; mode 0600); the path, for ``--cluster-secret-file``."""
    from splitserve.secret_file import write_secret_file

    return write_secret_file(str(path))


# the one the tests' split workers share; test processes of `pytest -n` take their starter's
CLUSTER_SECRET = str(LOGS / "cluster-secret") if _XDIST_WORKER else write_cluster_secret(LOGS / "cluster-secret")


def split_defaults(args: list[str], env: dict, trusted_prefill: str) -> list[str]:
    """``args`` of a ``serve``, with what a split worker of the tests needs unless they say
    otherwise: a decode worker trusts the bootstrap addresses on ``trusted_prefill``, and prefill
    and decode workers share ``CLUSTER_SECRET`` (a test about its absence says
    ``--insecure-control-plane``). A decode worker fails a room whose KV will not come
    (``--kv-failure-policy fail``) unless the test says otherwise: most fault tests are about
    what a failure frees and tells; the recompute fallback (the product's default) has its own
    (``test_kv_fallback.py``, ``test_recompute_faults.py``)."""
    given = {a.split("=")[0] for a in args}
    trust = ("--allowed-prefill", "--worker-api-key", "--worker-api-key-file")
    if role_of(args) == "decode" and not given & set(trust) and "SPLITSERVE_WORKER_API_KEY" not in env:
        args = [*args, "--allowed-prefill", trusted_prefill]
    if role_of(args) == "decode" and "--kv-failure-policy" not in given:
        args = [*args, "--kv-failure-policy", "fail"]
    if role_of(args) in ("prefill", "decode") and not given & {"--cluster-secret-file", "--insecure-control-plane"}:
        args = [*args, "--cluster-secret-file", CLUSTER_SECRET]
    return args


def tiny_model(arch: str = "llama") -> Path:
    """The tiny ``arch`` model (seed 0) in the tests' model cache, where the servers' ``--model
    tiny`` finds it: built once for the session (and every later one), not once per test file.
    ``build_tiny_model`` is deterministic in (arch, seed), so this is the checkpoint a fresh build
    would write; the build itself is ``test_tiny_model.py``'s."""
    from splitserve.testing.tiny import tiny_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
        return tiny_model_path(arch)


def tiny_llama_engine():
    """An in-process engine on the tiny llama (float32, 1,024 tokens of 4-token pages), built into
    the tests' model cache: for tests of what the engine does with a request's own parameters."""
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine

    path = tiny_model("llama")
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", max_total_tokens=1024, page_size=4))


def kernel_builds() -> list[str]:
    """The ``-march`` values the compiled kernels' tests build for: this CPU's (``native``) and, on a
    CPU with AVX-512, also ``x86-64-v3`` (AVX2, FMA, F16C): the code an AVX2-only machine runs,
    whose paths this machine's native build skips."""
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return ["native", "x86-64-v3"] if "avx512f" in flags else ["native"]


@contextlib.contextmanager
def kernels_built_for(march: str):
    """The compiled kernels built for ``march`` (``kernel_builds``), or None where they cannot be
    built; meanwhile every ``kernels.load()`` of the process gets that build too."""
    from splitserve.layers import kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.ENV_MARCH, march)
        yield kernels.load(force=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``splitserve serve`` subprocess on loopback.

    ``ServerProcess("--max-running-requests", "1").start()`` returns once ``/health`` answers 200
    (or raises with the server's output). ``url`` is its base URL; ``stop()`` sends SIGTERM, waits,
    kills if need be and returns the exit code; ``send_signal`` and ``wait`` drive it by hand.

    A decode worker takes bootstrap addresses on ``trusted_prefill`` (``--allowed-prefill``: every
    test's prefills listen there) unless its options say whom it trusts (``--allowed-prefill``, or
    the router's key) — as a deployment must say (``docs/security.md``).
    """

    trusted_prefill = "127.0.0.1"

    def __init__(self, *args: str, model: str = "tiny", cache_dir: Path = CACHE_DIR,
                 startup_timeout: float = STARTUP_TIMEOUT_S, env: Optional[dict] = None,
                 subcommand: str = "serve", tls: Optional[dict] = None):
        self.args = split_defaults(list(args), env or {}, self.trusted_prefill)
        self.model = model
        self.cache_dir = Path(cache_dir)
        self.startup_timeout = startup_timeout
        self.extra_env = dict(env or {})
        self.subcommand = subcommand
        self.tls = tls  # for a TLS server: requests' keywords to reach it ({"verify": CA, "cert": (crt, key)})
        self.port: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self._logdir = log_dir("server-")
        self._out = self._err = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "ServerProcess":
        for attempt in range(3):  # a free port can be taken between our probe and the server's bind
            self._spawn(free_port())
            try:
                self.wait_ready()
                return self
            except RuntimeError as exc:
                if "cannot listen" in str(exc) and attempt < 2:
                    continue
                self.stop(timeout=5)
                raise
        raise AssertionError("unreachable")

    def spawn(self) -> "ServerProcess":
        """Start it without waiting until it is ready (``wait_ready`` waits)."""
        self._spawn(free_port())
        return self

    def _spawn(self, port: int) -> None:
        self.port = port
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, SPLITSERVE_CACHE=str(self.cache_dir), PYTHONUNBUFFERED="1", **self.extra_env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "splitserve.cli", self.subcommand, "--model", self.model,
               "--host", "127.0.0.1", "--port", str(port), *self.args]
        self._close_logs()
        self._out = open(self._logdir / "stdout.log", "wb")
        self._err = open(self._logdir / "stderr.log", "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._out, stderr=self._err,
                                     stdin=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        _live.add(self)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"server exited with {rc} before it was ready\n{self.output_tail()}")
            try:  # its own ready line too: another process that took the port may answer there
                if requests.get(self.url + "/health", timeout=2, **(self.tls or {})).status_code == 200 \
                        and "splitserve ready: " in self.stdout():
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout or self.startup_timeout:.0f}s\n{self.output_tail()}")

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit code; raises subprocess.TimeoutExpired if it is still running."""
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        _live.discard(self)
        self._close_logs()
        return self.proc.returncode

    def _close_logs(self) -> None:
        for f in (self._out, self._err):
            if f is not None and not f.closed:
                f.close()

    def stdout(self) -> str:
        return self._read("stdout.log")

    def stderr(self) -> str:
        return self._read("stderr.log")

    def _read(self, name: str) -> str:
        path = self._logdir / name
        return path.read_text(errors="replace") if path.exists() else ""

    def output_tail(self, chars: int = 4000) -> str:
        return (f"--- stdout of {self.subcommand} on port {self.port} ---\n{self.stdout()[-chars:]}\n"
                f"--- stderr ---\n{self.stderr()[-chars:]}")

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def server():
    """The session's shared tiny-model server."""
    proc = ServerProcess().start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def pd_cluster():
    """The session's shared split cluster: 1 prefill + 1 decode tiny-model worker (NIXL) behind a
    router that splits every request; decode under the product's ``--kv-failure-policy
    recompute`` (a test may send decode a leg whose prefill it then says failed). For tests that
    only send requests and read answers (no metric counts, no faults that outlive a request):
    every test file that can shares it instead of starting its own."""
    from cluster import Cluster

    cluster = Cluster(prefill=1, decode=1, backend="nixl", decode_args=["--kv-failure-policy", "recompute"]).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def etcd_cluster():
    """The session's etcd and the workers registered in it, shared by test_discovery.py and
    test_membership.py (``tests/etcd_cluster.py``); skipped without etcd (failed under CI)."""
    from etcd_cluster import EtcdCluster

    with EtcdCluster(EtcdCluster.etcd_or_skip()) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def tiny_engine():
    """The session's in-process engine on the tiny llama (``tiny_llama_engine``), for tests of what
    the engine does with a request's own parameters; each leaves no request running."""
    return tiny_llama_engine()


@pytest.fixture
def start_server():
    """Start extra servers: ``start_server(*cli_args, **ServerProcess kwargs)``; all are stopped
    when the test ends, whatever happened."""
    started: list[ServerProcess] = []

    def start(*args: str, **kwargs) -> ServerProcess:
        proc = ServerProcess(*args, **kwargs)
        started.append(proc)
        return proc.start()

    try:
        yield start
    finally:
        for proc in started:
            proc.stop(timeout=10)


def make_byte_tokenizer():
    """A fast tokenizer with one token per byte (ids 0-255), ``<s>``=256, ``</s>``=257, and a
    simple chat template; no files, no model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<s>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    return fast


@pytest.fixture(scope="session")
def byte_tokenizer():
    return make_byte_tokenizer()
