"""The model cache: checkpoint folders splitserve builds once and reuses (the tiny test model, GGUF
files converted to safetensors).

The cache lives in ``$SPLITSERVE_CACHE``, else ``~/.cache/splitserve`` (read at call time).
:func:`build_once` makes a folder appear there exactly once: the builder runs under an fcntl lock
into a temporary folder beside the final one, which is renamed into place when complete. Callers
racing for the same folder wait and reuse it, a half-written folder is never visible, leftovers of
a crashed build are removed, and a folder that fails ``is_complete`` is rebuilt rather than trusted.
:func:`write_file_once` does the same for one file (the shared packed weights, ``packed_file.py``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from splitserve.file_trust import open_lock


def cache_root() -> Path:
    """$SPLITSERVE_CACHE, else ~/.cache/splitserve."""
    root = os.environ.get("SPLITSERVE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "splitserve"


def build_once(final: Path, build: Callable[[Path], object], is_complete: Callable[[Path], bool]) -> Path:
    """``final`` once ``is_complete(final)``; else build it: ``build(tmp)`` fills an empty temporary
    folder beside it, which is then renamed to ``final``. Safe to call from many processes at once:
    one builds under a lock (``.NAME.lock`` beside ``final``, released also if the builder dies);
    the others wait, then reuse its folder. A failing ``build`` leaves nothing behind and raises."""
    if is_complete(final):
        return final
    parent, name = final.parent, final.name
    parent.mkdir(parents=True, exist_ok=True)
    with open_lock(parent / f".{name}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we die
        try:
            if is_complete(final):  # someone else built it while we waited
                return final
            # We hold the lock: leftovers of a crashed build, or a broken folder, are garbage.
            for stale in parent.glob(f".{name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():
                broken = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-broken-"))
                os.rename(final, broken / "old")
                shutil.rmtree(broken, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-"))
            try:
                build(tmp)
                os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is an ordinary folder
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def write_file_once(final: Path, write: Callable[[object], object], is_valid: Callable[[Path], bool]) -> bool:
    """Make ``final`` a file that passes ``is_valid``: if it does not yet, ``write(f)`` fills a
    temporary file beside it (``f``: open for binary writing), which is renamed over it. Safe to call
    from many processes at once: one writes under a lock (``.NAME.lock``), the others wait, then
    find its file valid. A reader never sees a half-written file. Returns True if this call wrote."""
    if is_valid(final):
        return False
    parent, name = final.parent, final.name
    parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # only its owner writes it, whatever the umask
    with open_lock(parent / f".{name}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we die
        try:
            if is_valid(final):  # someone else wrote it while we waited
                return False
            for stale in parent.glob(f".{name}.tmp-*"):  # a crashed writer's files; a folder is not ours
                if stale.is_symlink() or stale.is_file():
                    stale.unlink(missing_ok=True)
            fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{name}.tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                os.chmod(tmp, 0o644)  # mkstemp made it private; the cache is shared by the host's workers
                os.replace(tmp, final)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return True
