"""The shared packed-weights file's format (``packed_file.py`` writes and shares it) and its one read
per worker start: :func:`read_checked` opens the file once, checks its owner and mode, header,
size and layout, maps it and verifies every tensor's checksum, and returns all that as one value
(``FileRead``) that the loader's attach and the runner's sharing both use. Layout::

    MAGIC (8 bytes) | header length (8, little-endian) | header JSON | tensors, each at a 4 KiB offset

The header holds the version, the key, the total size, the table (name, dtype, shape, offset,
bytes) and each tensor's CRC-32 (``crc32``), computed from the bytes written. Any change inside a
tensor since (a disk's damage, a write in place) fails the check, which is made at every start:
the checksum runs on as many threads as the process may use; ``docs/journal.md`` has its cost.
It guards against damage, not against an adversary (who could rewrite the header too): whoever
may write the file or its folder is kept out by the owner and mode checks (``file_trust.py``).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from splitserve.file_trust import owner_problem

FORMAT_VERSION = 2
MAGIC = b"SPSWGT1\0"
ALIGN = 4096  # each tensor on its own pages: mapped views are aligned for any kernel load
MAX_HEADER = 4 * 2**20  # a real header is tens of KB: a longer one is not parsed
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                                     torch.int8, torch.int32, torch.int64)}
Opener = Callable[[Path, int], int]  # os.open's shape: (path, flags) -> a file descriptor


@dataclass
class FileRead:
    """What one read of the file found: its header (None when it is not usable, ``why`` says why),
    the whole file mapped copy-on-write as uint8 (``whole``) and which file that was (``seen``:
    its device, inode, size, mtime and ctime; None when there was none), so a later step can tell,
    by one ``stat``, that the file is still the one read (``still``)."""

    path: Path
    header: Optional[dict]
    why: str = ""
    whole: Optional[torch.Tensor] = None
    seen: Optional[tuple] = None

    def start(self) -> int:
        """Where the tensors begin in ``whole``."""
        return data_start({k: v for k, v in self.header.items() if k != "size"})

    def views(self) -> list[torch.Tensor]:
        """Each tensor's bytes in ``whole``, in table order."""
        start = self.start()
        return [self.whole[start + r["offset"]:start + r["offset"] + r["nbytes"]] for r in self.header["table"]]


def seen_now(path: Path) -> Optional[tuple]:
    """The identity ``FileRead.seen`` records of the file at ``path`` now (None: none there)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ("unreadable", str(exc))
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def still(read: FileRead) -> bool:
    """The file at ``read.path`` is the one ``read`` read (or there is still none)."""
    return seen_now(read.path) == read.seen


def read_checked(path: Path, key: str, opener: Opener = os.open) -> FileRead:
    """The file at ``path`` read once through ``opener``: usable (``header`` set) only if it is a
    regular file of this user's that no one else may write, its header is of this format and
    ``key``, its size and offsets are where ``table_of`` lays its tensors, and every tensor's bytes
    match the header's checksum. Never raises: any error means "not usable", with why."""
    try:
        # non-blocking: a FIFO planted at the path must not hang the start; then only regular files
        fd = opener(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return FileRead(path, None, "missing", seen=None)
    except OSError as exc:
        return FileRead(path, None, f"cannot open it ({exc})", seen=seen_now(path))
    try:
        st = os.fstat(fd)
        read = FileRead(path, None, seen=(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        header, read.why = _header_from(fd, st)
        if header is not None:
            read.why = _layout_problem(header, key, st.st_size)
        if not read.why:
            read.header, read.whole = header, map_private(fd, st.st_size)
            read.why = damaged(read)
        if read.why:
            read.header = read.whole = None
        return read
    except Exception as exc:  # noqa: BLE001 -- a header that passed its checks yet breaks one: not ours
        return FileRead(path, None, f"its header does not describe it ({type(exc).__name__})", seen=seen_now(path))
    finally:
        os.close(fd)


def header_of(path: Path) -> tuple[Optional[dict], str]:
    """The file's header and "", or None and why it is not one (missing, short, wrong magic, bad
    JSON, fields of the wrong type, not a regular file, not this user's alone); no contents check."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, f"cannot open it ({exc})"
    try:
        return _header_from(fd, os.fstat(fd))
    finally:
        os.close(fd)


def _header_from(fd: int, st: os.stat_result) -> tuple[Optional[dict], str]:
    """The header of the open file ``fd`` (``st``: its ``fstat``) and "", or None and why not.
    Any error reading or parsing it (deep nesting's RecursionError included) means "not ours"."""
    if not stat.S_ISREG(st.st_mode):
        return None, "not a regular file"
    problem = owner_problem(st)
    if problem:
        return None, f"the file {problem}"
    try:
        head = os.pread(fd, len(MAGIC) + 8, 0)
        if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
            return None, "not a weights file (short or wrong magic)"
        (length,) = struct.unpack("<Q", head[len(MAGIC):])
        if length > MAX_HEADER:
            return None, f"a header of {length} bytes"
        header = json.loads(os.pread(fd, length, len(head)))
    except Exception as exc:  # noqa: BLE001 -- RecursionError, ValueError, OSError: all mean not ours
        return None, f"unreadable header ({type(exc).__name__})"
    problem = header_problem(header)
    return (None, problem) if problem else (header, "")


def _layout_problem(header: dict, key: str, file_size: int) -> str:
    """Why a well-typed ``header`` does not describe a file of ``key`` and ``file_size`` bytes
    ("" if it does): its tensors must lie where ``table_of`` puts them, the last ending the file."""
    if header["key"] != key:
        return "its key is not this model's"
    rows = header["table"]
    if table_of(rows) != rows:
        return "its table's offsets are not where its tensors go"
    if header["size"] != end_of(header) or file_size != header["size"]:
        return "its size is not where its last tensor ends"
    return ""


def damaged(read: FileRead) -> str:
    """The first tensor of ``read`` whose bytes do not match the header's checksum, as a reason
    ("" if none)."""
    for row, want, got in zip(read.header["table"], read.header["crc32"], checksums(read.views())):
        if want != got:
            return f"{row['name']} differs from its header's checksum (damaged since written)"
    return ""


def checksums(flats: list[torch.Tensor]) -> list[int]:
    """Each uint8 tensor's CRC-32, on as many threads as this process may use (``zlib`` lets go
    of the GIL while it sums)."""
    threads = max(1, min(len(os.sched_getaffinity(0)), len(flats), 16))
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda flat: zlib.crc32(flat.numpy()), flats))


def map_private(fd: int, size: int) -> torch.Tensor:
    """The open file ``fd``'s first ``size`` bytes mapped copy-on-write (the page cache's pages,
    shared with every process mapping the file, until one is written) as a uint8 tensor."""
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping for as long as it lives


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def header_problem(header) -> str:
    """Why ``header`` is not a well-typed header of this format ("" if it is): the version, size,
    offsets, byte counts, shape entries and checksums must be integers (not floats, not booleans)."""
    if not isinstance(header, dict):
        return "its header is not an object"
    if not _is_int(header.get("version")) or header["version"] != FORMAT_VERSION:
        return f"format version {header.get('version')!r}, not {FORMAT_VERSION}"
    if not isinstance(header.get("key"), str) or not _is_int(header.get("size")):
        return "its key or size is not of the right type"
    rows, sums = header.get("table"), header.get("crc32")
    if not isinstance(rows, list) or not isinstance(sums, list) or len(sums) != len(rows) \
            or not all(_is_int(s) for s in sums):
        return "its table or checksums are not lists of the right length"
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("name"), str) \
                or not isinstance(row.get("dtype"), str) or row["dtype"] not in DTYPES \
                or not _is_int(row.get("offset")) or not _is_int(row.get("nbytes")) \
                or not isinstance(row.get("shape"), list) or not all(_is_int(n) for n in row["shape"]):
            return "a table row is not of the right types"
    if len({row["name"] for row in rows}) != len(rows):  # a name twice: which bytes are its would be ambiguous
        return "its table names a tensor twice"
    return ""


def table_of(rows: list[dict]) -> list[dict]:
    """``rows`` with their offsets and sizes as ``table`` lays out such tensors (a header's check)."""
    out, offset = [], 0
    for r in rows:
        nbytes = _nbytes(r)
        out.append({**r, "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    return out


def _nbytes(row: dict) -> int:
    count = 1
    for n in row["shape"]:
        count *= n
    return count * torch.empty(0, dtype=DTYPES[row["dtype"]]).element_size()


def header_bytes(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def data_start(header: dict) -> int:
    """Where the tensors begin: after magic, length and header JSON (with the size filled in), aligned."""
    body = len(header_bytes({**header, "size": 0})) + 32  # room for the size's digits
    return -(-(len(MAGIC) + 8 + body) // ALIGN) * ALIGN


def end_of(header: dict) -> int:
    """Where the file of ``header`` ends: its data's start plus its last tensor's end."""
    rows = header["table"]
    return data_start({k: v for k, v in header.items() if k != "size"}) + \
        (rows[-1]["offset"] + rows[-1]["nbytes"] if rows else 0)
