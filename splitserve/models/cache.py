"""The model cache: checkpoint folders splitserve builds once and reuses (the tiny test model, GGUF
files converted to safetensors).

The cache lives in ``$SPLITSERVE_CACHE``, else ``~/.cache/splitserve`` (read at call time).
:func:`build_once` makes a folder appear there exactly once: the builder runs under an fcntl lock
into a temporary folder beside the final one, which is renamed into place when complete. Callers
racing for the same folder wait and reuse it, a half-written folder is never visible, leftovers of
a crashed build are removed, and a folder that fails ``is_complete``, or that another user owns or
may write (``file_trust.py``), is rebuilt rather than trusted; a cache folder others may write is
refused (``UntrustedCache``, naming it and the fix).
:func:`write_file_once` does the same for one file (the shared packed weights, ``packed_file.py``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

from splitserve.file_trust import open_lock, untrusted, untrusted_folder

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """$SPLITSERVE_CACHE, else ~/.cache/splitserve."""
    root = os.environ.get("SPLITSERVE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "splitserve"


class UntrustedCache(PermissionError):
    """The model cache's folder may be written by others: nothing is built or used there."""


def build_once(final: Path, build: Callable[[Path], object], is_complete: Callable[[Path], bool]) -> Path:
    """``final`` once ``is_complete(final)``; else build it: ``build(tmp)`` fills an empty temporary
    folder beside it, which is then renamed to ``final``. Safe to call from many processes at once:
    one builds under a lock (``.NAME.lock`` beside ``final``, released also if the builder dies);
    the others wait, then reuse its folder. A failing ``build`` leaves nothing behind and raises.
    A ``final`` that another user owns or others may write (it, or anything in it), or that is a
    symbolic link, is never used: it is moved aside and rebuilt, with a warning. Where ``final``'s
    parent folder is such, ``UntrustedCache`` names it and the fix."""
    parent, name = final.parent, final.name
    _refuse_untrusted(parent)
    if not untrusted_folder(final) and is_complete(final):
        return final
    parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # only its owner writes it, whatever the umask
    _refuse_untrusted(parent)  # made by someone else meanwhile
    with open_lock(parent / f".{name}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we die
        try:
            problem = untrusted_folder(final)
            if not problem and is_complete(final):  # someone else built it while we waited
                return final
            if problem:
                log.warning("the model cache folder %s is not used: %s; rebuilding it", final, problem)
            # We hold the lock: leftovers of a crashed build, or a broken folder, are garbage.
            for stale in parent.glob(f".{name}.tmp-*"):
                _remove(stale)
            if final.is_symlink() or final.exists():
                _move_aside(final, problem)
            tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-"))
            try:
                build(tmp)
                _only_owner_writes(tmp)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def _refuse_untrusted(parent: Path) -> None:
    """Raise ``UntrustedCache`` where the existing folder ``parent`` fails ``file_trust.untrusted``."""
    problem = untrusted([parent])
    if problem:
        raise UntrustedCache(f"the model cache folder {problem}: nothing is built or used there, since whoever "
                             f"may write it can swap what a worker loads. Make it yours and writable only by "
                             f"you (chown; chmod go-w {parent}), or set SPLITSERVE_CACHE to a folder of your own")


def _move_aside(final: Path, problem: str) -> None:
    """Remove ``final`` (a broken or untrusted folder, a link), first renamed beside itself: a
    folder moves within its parent without write access to itself (only a move across folders
    rewrites its '..'), so one another user owns goes too. ``UntrustedCache`` where it cannot."""
    broken = final.parent / f".{final.name}.tmp-broken-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(final, broken)
    except OSError as exc:
        raise UntrustedCache(f"the model cache folder {final} ({problem or 'incomplete'}) cannot be moved aside to "
                             f"be rebuilt ({exc}): remove it") from exc
    _remove(broken)


def _remove(path: Path) -> None:
    """Remove a leftover of ours: a link itself (never what it points to), else the folder or file."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _only_owner_writes(folder: Path) -> None:
    """Take group and others' write permission off ``folder`` and everything in it (mkdtemp made
    it private, the builder's files follow the umask): the cache is an ordinary folder, and
    ``build_once`` uses only folders no one else may write."""
    for path in [folder, *(Path(top) / n for top, dirs, files in os.walk(folder) for n in [*dirs, *files])]:
        if path.is_symlink():
            continue
        os.chmod(path, 0o755 if path == folder else stat.S_IMODE(os.lstat(path).st_mode) & ~0o022)


def write_file_once(final: Path, write: Callable[[object], object], is_valid: Callable[[Path], bool]) -> bool:
    """Make ``final`` a file that passes ``is_valid``: if it does not yet, ``write(f)`` fills a
    temporary file beside it (``f``: open for binary writing and reading, so ``write`` may map what
    it wrote), which is renamed over it. Safe to call from many processes at once: one writes
    under a lock (``.NAME.lock``), the others wait, then find its file valid. A reader never sees a
    half-written file. Returns True if this call wrote."""
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
                with os.fdopen(fd, "w+b") as f:
                    write(f)
                os.chmod(tmp, 0o644)  # mkstemp made it private; the cache is shared by the host's workers
                os.replace(tmp, final)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return True
