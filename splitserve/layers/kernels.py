"""The compiled CPU kernels (``cpu_kernels.cpp``, ``matmul_kernels.cpp``): built on first use, cached
on disk, optional.

``load()`` returns the extension module, or None, and the model then runs the PyTorch reference
ops (``layers/ops.py``): when ``SPLITSERVE_KERNELS=0`` (the test suite sets it for every test
but the kernels' own), or when the build fails (no C++ compiler, no ninja, a compile error;
logged once with the reason). The build goes through ``torch.utils.cpp_extension.load`` into
``$SPLITSERVE_CACHE/kernels`` (else ``~/.cache/splitserve/kernels``) under a name hashed from the
sources, the compiler flags, the torch version and this CPU's instruction-set flags (the code is
built for the CPU it runs on, ``-march=native``), so a later start loads it in a fraction of a
second; processes building at once wait on the build folder's lock. Environment read at call time.

``SPLITSERVE_KERNELS_MARCH`` builds for another instruction set than this CPU's (gcc's ``-march``
value), one this CPU can run: ``x86-64-v3`` (AVX2, FMA, F16C) gives on an AVX-512 machine the code
an AVX2-only machine runs, so that its paths are tested and measured here too.

On an AMX-INT8 CPU, ``quant_linear`` runs Q4_0/Q8_0 calls of 16+ rows on the tiles with the vector
path's bits; ``SPLITSERVE_KERNELS_AMX=0`` (read at each call) keeps them off (``quant_amx_available()``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from splitserve.file_trust import open_lock, untrusted

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_kernels.cpp", "matmul_kernels.cpp"))
# -fopenmp: at::parallel_for is inline OpenMP; the module then uses the libgomp.so.1 torch loaded
CFLAGS = ("-O3", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp")  # and -march (march())
LDFLAGS = ("-fopenmp",)  # tuples: cpp_extension.load appends torch's libraries to the lists it is given
ENV_SWITCH = "SPLITSERVE_KERNELS"
ENV_MARCH = "SPLITSERVE_KERNELS_MARCH"

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def enabled() -> bool:
    """False when ``SPLITSERVE_KERNELS`` is 0/false/off/no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def march() -> str:
    """The instruction set the kernels are built for: ``native`` unless ``SPLITSERVE_KERNELS_MARCH``
    names another (letters, digits, ``-``, ``_`` and ``.`` only: it goes on a compiler's command line)."""
    value = os.environ.get(ENV_MARCH, "").strip() or "native"
    if not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(f"{ENV_MARCH}={value!r} is not a -march value (e.g. native, x86-64-v3)")
    return value


def cflags() -> list[str]:
    return [f"-march={march()}", *CFLAGS]


def cache_dir() -> Path:
    root = os.environ.get("SPLITSERVE_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "splitserve") / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build_name() -> str:
    sources = [s.read_text() for s in SOURCES]
    key = "\0".join([*sources, " ".join([*cflags(), *LDFLAGS]), torch.__version__, _cpu_flags()])
    return "splitserve_cpu_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def load(force: bool = False):
    """The kernels' op namespace (``torch.ops.<name>``: ``decode_attention``, ``add_rms_norm``,
    ``rope_store``, ``silu_mul``, the ``quant_*`` ops of ``layers/quant.py``), building them if needed; None when switched off or unavailable.
    ``force``: ignore the switch (the kernels' own tests)."""
    if not force and not enabled():
        return None
    name = build_name()
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name)
        return _loaded[name]


def _build(name: str):
    try:
        from torch.utils import cpp_extension

        build_dir = cache_dir() / name
        build_dir.parent.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        for folder in (build_dir.parent, build_dir):  # ours: 755 whatever the umask (their check below)
            folder.mkdir(mode=0o755, exist_ok=True)
        refused = untrusted([build_dir.parent.parent, build_dir.parent, build_dir, build_dir / f"{name}.so"])
        if refused:  # a library others can write is their code in this worker
            log.warning("compiled CPU kernels not loaded, using the PyTorch ops instead: %s", refused)
            return None
        if not (build_dir / f"{name}.so").is_file():
            log.info("building the compiled CPU kernels (-march=%s) into %s (once per machine and version: "
                     "seconds to a minute)", march(), build_dir)
        # the sources copied in: the build command then names the same files from any checkout (ninja
        # rebuilds, 8 s, when a command changes; the name already says which sources they are)
        sources = []
        for original in SOURCES:
            source = build_dir / original.name
            text = original.read_text()
            if not source.is_file() or source.read_text() != text:
                tmp = source.with_suffix(f".{os.getpid()}.tmp")
                tmp.unlink(missing_ok=True)  # never written through: a link planted there is not followed
                with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
                    f.write(text)
                os.replace(tmp, source)
            sources.append(str(source))
        with build_lock(build_dir):
            cpp_extension.load(name=name, sources=sources, extra_cflags=[*cflags(), f"-DSPLITSERVE_OPS={name}"],
                               extra_ldflags=list(LDFLAGS), build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
        library = build_dir / f"{name}.so"
        mode = library.stat().st_mode
        if mode & 0o022:  # the linker's mode follows the umask: keep the next start's check
            os.chmod(library, mode & ~0o022)
        log.info("compiled CPU kernels (-march=%s) loaded from %s", march(), build_dir)
        return getattr(torch.ops, name)
    except Exception as exc:  # compiler or ninja missing, compile error: run the PyTorch ops instead
        log.warning("compiled CPU kernels unavailable, using the PyTorch ops instead: %s", _reason(exc))
        return None


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold our flock on ``build_dir/splitserve.lock`` (released also if we die) around a build. While
    we hold it no build of ours runs there, so torch's ``lock`` file there is a killed build's, on
    which every later build would wait forever: it is removed, with a warning naming it."""
    with open_lock(build_dir / "splitserve.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we die
        stale = build_dir / "lock"
        if stale.exists() or stale.is_symlink():
            log.warning("removing %s, the build lock of a kernels build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


def _reason(exc: Exception) -> str:
    """The first compiler error of a failed build, else the exception's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "build stopped" not in line]
    return (errors or lines or [type(exc).__name__])[0 if errors else -1]
