"""Whether a file or folder in the cache may be trusted, and how its lock files are opened: what
a worker maps as its weights (``models/packed_file.py``), loads as a checkpoint (the folders
``models/cache.build_once`` makes) or loads as code (``layers/kernels.py``) must be this process's
user's and writable by no one else, since whoever can write it can make any check of its contents
pass (or, for a shared library, run their code in the worker); a lock file is opened without
following a link or blocking on a FIFO planted at its path."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, Optional


def owner_problem(st: os.stat_result, uid: Optional[int] = None) -> str:
    """Why a file or folder of these ``stat`` results is not trusted ("" if it is). ``uid``: whose
    it must be (default: this process's effective user)."""
    uid = os.geteuid() if uid is None else uid
    if st.st_uid != uid:
        return f"is owned by user {st.st_uid}, not by this process's {uid}"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def untrusted(paths: Iterable[Path], uid: Optional[int] = None) -> str:
    """The first of ``paths`` that exists and is not trusted, and why ("" if none)."""
    for path in paths:
        try:
            st = os.stat(path)  # follows a symlink: judges what would be opened
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{path}: cannot stat it ({exc})"
        problem = owner_problem(st, uid)
        if problem:
            return f"{path} {problem}"
    return ""


def untrusted_folder(folder: Path, uid: Optional[int] = None) -> str:
    """Why the folder ``folder`` and what it holds must not be used ("" if they may, or if there is
    nothing there): a symbolic link (what it points to is not the cache's to vouch for), or the
    folder or anything under it failing ``owner_problem``."""
    if folder.is_symlink():
        return f"{folder} is a symbolic link, not a folder of the cache"
    if not folder.exists():
        return ""
    inside = [Path(top) / name for top, dirs, files in os.walk(folder) for name in [*dirs, *files]]
    return untrusted([folder, *inside], uid)


def open_lock(path: Path):
    """The lock file ``path`` open for writing (a file object to ``flock``), created if missing,
    never truncated and never through a symlink (one planted there would have its target emptied).
    Opened without blocking (a FIFO planted there would block the open forever); OSError where it
    is a symlink or not a regular file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"the lock {path} is not a regular file: remove it")
    return os.fdopen(fd, "wb")
