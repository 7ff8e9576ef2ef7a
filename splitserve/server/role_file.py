"""A worker's role in a file (``serve --role-file PATH``), for whoever starts it again.

The worker writes its role at start and at each role switch (``POST /role``, written before the
switch is answered), each time whole: a new file beside it, then renamed over it, so a reader
never sees half of one, even when the worker is killed while writing. ``splitserve launch`` reads
it before it restarts a worker that exited, so a worker switched and then killed comes back in
the role it had switched to.

The reader takes the file as untrusted local input: at most :data:`MAX_BYTES`, a regular file
only (a FIFO would block it, a device could be endless), and one of the roles it knows; anything
else is refused with why, and the caller falls back to the role it started the worker in.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from typing import Optional

log = logging.getLogger(__name__)

MAX_BYTES = 64
ROLES = ("prefill", "decode")


def write_role(path: str, role: str) -> None:
    """``role`` and a newline in ``path``, replacing what was there in one rename. OSError when
    it cannot be written (the folder is missing or not writable)."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(role + "\n")
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def keep_role(path: str, role: str, when: str) -> bool:
    """``role`` written to ``path`` (:func:`write_role`); a file that cannot be written is logged
    and the worker serves on (``when``: at start, a role switch), since a worker that stopped
    over it would only be restarted into the same failure: False then."""
    try:
        write_role(path, role)
        return True
    except OSError as exc:
        log.error("%s: cannot write --role-file %s (%s): a restart would take the role it was launched in",
                  when, path, exc)
        return False


def read_role(path: str) -> tuple[Optional[str], str]:
    """The role ``path`` holds (``prefill`` or ``decode``) and ``""``, or None and why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        return None, f"cannot open it ({exc.strerror or exc})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "it is not a regular file"
        data = os.read(fd, MAX_BYTES + 1)
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror or exc})"
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        return None, f"it holds more than {MAX_BYTES} bytes"
    text = data.decode("ascii", errors="replace").strip()
    if text not in ROLES:
        return None, f"it holds {text[:20]!r}, not one of {', '.join(ROLES)}"
    return text, ""
