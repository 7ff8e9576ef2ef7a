"""One copy of a model's converted weights per host: a file in the model cache that every worker
on the host maps read-only instead of holding its own copy (README, one copy of the weights).

:func:`share_weights` writes a worker's loaded, packed weights (``layers/linear.py``'s
``shared_tensors``) once to ``$SPLITSERVE_CACHE/packed/NAME-KEY.weights`` and points each tensor at
a private (copy-on-write) mapping of it, so the pages are the page cache's, counted once per host.
The key hashes all that changes the bytes: the checkpoint's identity (``weights_identity``: its
quantization plan, dtype), the kernels' build, every ``.py`` under ``models/`` and ``layers/``, the
``gguf`` and torch versions and ``FORMAT_VERSION``. Layout::

    MAGIC (8 bytes) | header length (8, little-endian) | header JSON | tensors, each at a 4 KiB offset

The header holds the version, the key, the total size, the table (name, dtype, shape, offset,
bytes) and a hash of each tensor's first and last 4 KiB. A file is trusted only when its size,
magic, version, key and table are this process's and every tensor's first and last 4 KiB check
out (against its own bytes, or the header's hashes when it maps without loading: ``attach_file``):
a sample (a whole hash would cost seconds per start); one that fails is rebuilt, by rename under a
lock (``cache.write_file_once``). One (or a folder) others can write is never used (``unsafe_place``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from splitserve.file_trust import owner_problem, untrusted
from splitserve.models.cache import cache_root, write_file_once

log = logging.getLogger(__name__)
_told: set[str] = set()  # the reasons already logged: each once per process

FORMAT_VERSION = 1
MAGIC = b"SPSWGT1\0"
ALIGN = 4096  # each tensor on its own pages: mapped views are aligned for any kernel load
SAMPLE = 4096  # bytes compared at each end of every tensor
MAX_HEADER = 4 * 2**20  # a real header is tens of KB: a longer one is not parsed
MIN_BYTES = 64 * 2**20  # below this a model's weights are not worth a file (the tiny test models)
ENV_SWITCH = "SPLITSERVE_SHARED_WEIGHTS"
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                                      torch.int8, torch.int32, torch.int64)}


@dataclass
class Shared:
    """What ``share_weights`` did: the file, bytes now mapped from it, bytes left private."""

    path: Optional[Path]
    mapped_bytes: int
    private_bytes: int
    rebuilt: bool = False  # this process wrote the file


def enabled() -> bool:
    """False when ``SPLITSERVE_SHARED_WEIGHTS`` is 0/false/off/no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """The model's weight tensors that a file can hold, by a stable name, and the bytes of those
    it cannot (opaque oneDNN tensors). A module with ``shared_tensors`` names its own; any other
    gives its direct parameters. Tensors met twice (a tied weight) are named once."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    private = 0
    for path, module in model.named_modules():
        own = module.shared_tensors() if hasattr(module, "shared_tensors") else \
            {n: p for n, p in module.named_parameters(recurse=False)}
        extra = {"packed_head": getattr(module, "_packed_head", None)}  # a tied bfloat16 head's oneDNN copy
        for name, t in [*own.items(), *extra.items()]:
            if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            if t.layout != torch.strided or t.device.type != "cpu" or not t.is_contiguous():
                private += _opaque_bytes(t)
                continue
            if t.data_ptr() in seen or str(t.dtype).removeprefix("torch.") not in _DTYPES:
                continue
            seen.add(t.data_ptr())
            found[f"{path}.{name}" if path else name] = t
    return found, private


def _opaque_bytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError):
        return 0


def table(tensors: dict[str, torch.Tensor]) -> list[dict]:
    """The file's table for ``tensors``: name, dtype, shape, offset (from the file's start) and bytes."""
    rows, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        rows.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                     "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    return rows


def file_key(identity: dict, build: str, code: str, gguf_version: str) -> str:
    """The hash naming the file: the checkpoint's identity, the kernels' build, the converting code's
    digest (``code_digest``), the ``gguf`` library's version, torch, the format (the table is the
    header's, compared: a loader knows the key before it has the tensors)."""
    text = json.dumps({"version": FORMAT_VERSION, "identity": identity, "build": build, "code": code,
                       "gguf": gguf_version, "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def file_path(identity: dict, folder: Optional[Path] = None) -> tuple[Path, str]:
    """Where the file of a checkpoint ``identity`` lives, and its key."""
    key = file_key(identity, kernels_build(), _own_code(), gguf_version())
    folder = Path(folder) if folder is not None else cache_root() / "packed"
    return folder / f"{_safe(identity.get('name', 'model'))}-{key[:20]}.weights", key


def code_digest(folders: list[Path]) -> str:
    """A hash of every ``.py`` file under ``folders``, by sorted path: the code whose changes may
    change the converted and packed bytes."""
    digest = hashlib.sha256()
    for folder in folders:
        for source in sorted(Path(folder).rglob("*.py")):
            digest.update(str(source.relative_to(folder)).encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _own_code() -> str:
    package = Path(__file__).resolve().parent.parent
    return code_digest([package / "models", package / "layers"])


def gguf_version() -> str:
    """The installed ``gguf`` library's version (it dequantizes GGUF checkpoints), "none" without it."""
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def kernels_build() -> str:
    """The compiled kernels' build name (it hashes their sources, flags, torch and the CPU's flags)."""
    from splitserve.layers import kernels

    return kernels.build_name()


def share_weights(model: torch.nn.Module, identity: Optional[dict] = None, min_bytes: int = MIN_BYTES,
                  cache_dir: Optional[Path] = None) -> Shared:
    """Point ``model``'s weight tensors at the host's one file of them (written first if no valid
    one exists). ``identity``: the checkpoint's (default: the loader's ``model.weights_identity``;
    none: nothing is shared); ``min_bytes``: share only models with at least this many bytes of
    weights; ``cache_dir``: the folder of the files (default ``$SPLITSERVE_CACHE/packed``)."""
    identity = identity if identity is not None else getattr(model, "weights_identity", None)
    tensors, private = model_tensors(model)
    rows = table(tensors)
    total = sum(r["nbytes"] for r in rows)
    if identity is None or not enabled() or total < max(min_bytes, 1):
        return Shared(None, 0, total + private)
    path, key = file_path(identity, cache_dir)
    refused = unsafe_place(path)
    if refused:
        _reject(path, refused, "this worker keeps its own copy and writes none")
        return Shared(None, 0, total + private)
    if getattr(model, "weights_file", None) == path and _mapped_from(path, key, rows):
        return Shared(path, total, private)  # the loader mapped it: nothing to write or point
    header = {"version": FORMAT_VERSION, "key": key, "table": rows,
              "samples": [sample_digest(t.detach().reshape(-1).view(torch.uint8)) for t in tensors.values()]}
    try:
        wrote = write_file_once(path, lambda f: write_tensors(f, header, tensors),
                                lambda p: mapped_if_valid(p, key, rows, tensors) is not None)
    except OSError as exc:  # a full disk, a read-only cache: serve from our own copy
        log.warning("cannot write the shared weights file %s (%s); this worker keeps its own copy", path, exc)
        return Shared(None, 0, total + private)
    whole, why = checked_mapping(path, key, rows, tensors)
    if whole is None:  # replaced by a broken one since: keep our own copy
        log.warning("the shared weights file %s failed its check just after it was written (%s); weights stay "
                    "private", path, why)
        return Shared(None, 0, total + private)
    _point_at(tensors, rows, whole, _data_start(header))
    _release_freed_memory()
    if wrote:
        remove_older(path)
    log.info("weights: %.1f MiB mapped from %s (%s); %.1f MiB private", total / 2**20, path,
             "written" if wrote else "reused", private / 2**20)
    return Shared(path, total, private, wrote)


def remove_older(path: Path) -> list[Path]:
    """Remove the other files of ``path``'s model (other keys: earlier builds or settings), ours
    only, so the cache holds one file per model instead of one per build ever run: a worker still
    mapping one keeps its pages (an unlinked file lives while mapped); a later start of that
    build writes its own again. The files removed."""
    stem = path.name[:-len("-0123456789abcdef0123.weights")]  # file_path's name less its key
    pattern = re.compile(re.escape(stem) + r"-[0-9a-f]{20}\.weights")
    removed = []
    for other in path.parent.iterdir():
        if other == path or not pattern.fullmatch(other.name) or other.is_symlink() or not other.is_file():
            continue
        try:
            if owner_problem(other.stat()):
                continue
            other.unlink()
            removed.append(other)
        except OSError:
            continue
    if removed:
        log.info("removed %d older shared weights file(s) of this model: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def attach_file(model: torch.nn.Module, identity: dict, ops, cache_dir: Optional[Path] = None) -> Optional[Shared]:
    """Give a model just made (not loaded) its weights from the host's file, if a valid one holds
    exactly what it needs (``shared_shapes``; every other module's parameters): its size, magic,
    version, key and table checked, and each tensor's first and last 4 KiB against the header's
    hashes. None, having changed nothing, where there is none, it does not fit or fails a check,
    or ``SPLITSERVE_SHARED_WEIGHTS`` is off. ``ops``: the compiled kernels the quantized layers run on."""
    if not enabled():
        return None
    path, key = file_path(identity, cache_dir)
    refused = unsafe_place(path)
    if refused:
        _reject(path, refused, "this worker keeps its own copy and writes none")
        return None
    needed = {}
    for prefix, module in model.named_modules():
        own = module.shared_shapes() if hasattr(module, "shared_shapes") else \
            {n: (str(p.dtype).removeprefix("torch."), tuple(p.shape))
             for n, p in module.named_parameters(recurse=False) if p.numel()}
        needed.update({f"{prefix}.{n}" if prefix else n: (d, list(shape)) for n, (d, shape) in own.items()})
    try:
        rows, views, why = _views_if_fit(path, key, needed)
    except Exception as exc:  # noqa: BLE001 -- a header that passed its checks yet breaks one: not ours
        rows, views, why = None, None, f"its header does not describe it ({type(exc).__name__})"
    if rows is None:
        _reject(path, why, "loading the checkpoint (it is rebuilt)")
        return None
    for row, view in zip(rows, views):
        prefix, _, attr = row["name"].rpartition(".")
        view = view.view(_DTYPES[row["dtype"]]).view(row["shape"])
        module = model.get_submodule(prefix)
        if hasattr(module, "attach_shared"):
            module.attach_shared(attr, view, ops)
        else:
            with torch.no_grad():
                getattr(module, attr).set_(view)
    total = sum(r["nbytes"] for r in rows)
    model.weights_file = path
    log.info("weights: %.1f MiB mapped from %s, not loaded", total / 2**20, path)
    return Shared(path, total, 0)


def _views_if_fit(path: Path, key: str, needed: dict) -> tuple[Optional[list], Optional[list], str]:
    """The file's table and each tensor's bytes (views of its mapping), if it is of ``key``, holds
    exactly ``needed`` and its tensors' first and last 4 KiB match its header's hashes; else None,
    None and why not."""
    header, why = header_of(path)
    if header is None:
        return None, None, why
    if header["key"] != key:
        return None, None, "its key is not this model's"
    if not _fits(header, needed):
        return None, None, "its table is not this model's tensors"
    if os.stat(path).st_size != header["size"]:
        return None, None, "its size is not its header's"
    rows = header["table"]
    whole = torch.from_file(str(path), shared=False, size=header["size"], dtype=torch.uint8)
    start = _data_start({k: v for k, v in header.items() if k != "size"})
    views = [whole[start + row["offset"]:start + row["offset"] + row["nbytes"]] for row in rows]
    if header["samples"] != [sample_digest(v) for v in views]:
        return None, None, "its contents do not match its header"
    return rows, views, ""


def _mapped_from(path: Path, key: str, rows: list[dict]) -> bool:
    """The file at ``path`` is still the one of ``key`` and ``rows`` (not replaced since it was mapped)."""
    header = read_header(path)
    return header is not None and header.get("key") == key and header.get("table") == rows


def sample_digest(flat: torch.Tensor) -> str:
    """A hash of a tensor's first and last ``SAMPLE`` bytes (``flat``: its bytes): the header's check of
    a file's contents where there is no copy to compare with (a whole hash would cost seconds)."""
    n = min(SAMPLE, flat.numel())
    return hashlib.sha256(flat[:n].numpy().tobytes() + flat[-n:].numpy().tobytes()).hexdigest()[:32]


def _fits(header: dict, needed: dict) -> bool:
    """The header's table names exactly ``needed`` (name -> (dtype, shape)), laid out as ``table``
    lays it out, and its size is where the last tensor ends."""
    rows = header.get("table")
    try:
        if {r["name"]: (r["dtype"], r["shape"]) for r in rows} != needed or table_of(rows) != rows:
            return False
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return header.get("size") == _end(header, rows)


def _end(header: dict, rows: list[dict]) -> int:
    start = _data_start({k: v for k, v in header.items() if k != "size"})
    return start + (rows[-1]["offset"] + rows[-1]["nbytes"] if rows else 0)


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
    return count * torch.empty(0, dtype=_DTYPES[row["dtype"]]).element_size()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60] or "model"


def _header_bytes(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def _data_start(header: dict) -> int:
    """Where the tensors begin: after magic, length and header JSON (with the size filled in), aligned."""
    body = len(_header_bytes({**header, "size": 0})) + 32  # room for the size's digits
    return -(-(len(MAGIC) + 8 + body) // ALIGN) * ALIGN


def write_tensors(f, header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write the file to the open binary file ``f``: magic, header, each tensor at its offset."""
    start = _data_start(header)
    rows = header["table"]
    end = start + (rows[-1]["offset"] + rows[-1]["nbytes"] if rows else 0)
    body = _header_bytes({**header, "size": end})
    f.write(MAGIC + struct.pack("<Q", len(body)) + body)
    for row, t in zip(rows, tensors.values()):
        f.seek(start + row["offset"])
        f.write(t.detach().reshape(-1).view(torch.uint8).numpy().data)
    f.truncate(end)


def read_header(path: Path) -> Optional[dict]:
    """The file's header, or None where the file is not one of ours (``header_of`` says why)."""
    return header_of(path)[0]


def header_of(path: Path) -> tuple[Optional[dict], str]:
    """The file's header and "", or None and why it is not one: missing, short, wrong magic, bad
    JSON, or fields of the wrong type (``header_problem``). Never raises: any error reading or
    parsing it (deep nesting's RecursionError included) means "not ours", and so does anything but
    a regular file (a FIFO, a folder), opened without blocking."""
    try:
        # non-blocking: a FIFO planted at the path must not hang the start; then only regular files
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, "not a regular file"
            problem = owner_problem(st)
            if problem:
                return None, f"the file {problem}"
            head = f.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
                return None, "not a weights file (short or wrong magic)"
            (length,) = struct.unpack("<Q", head[len(MAGIC):])
            if length > MAX_HEADER:
                return None, f"a header of {length} bytes"
            header = json.loads(f.read(length))
    except FileNotFoundError:
        return None, "missing"
    except Exception as exc:  # noqa: BLE001 -- RecursionError, ValueError, OSError: all mean not ours
        return None, f"unreadable header ({type(exc).__name__})"
    problem = header_problem(header)
    return (None, problem) if problem else (header, "")


def unsafe_place(path: Path, uid: Optional[int] = None) -> str:
    """Why the file at ``path`` or its folder must not be used ("" if they may): one that another
    user owns or that group or others may write (whoever can write it can make any change pass
    the checks, the hashes being in its header), or a folder where the file belongs (not removed:
    it is not ours to delete). ``uid``: whose they must be (default: ours)."""
    if path.is_dir():  # follows a symlink, as opening it would
        return f"{path} is a folder, not a weights file (remove it to share the weights)"
    return untrusted([path.parent, path], uid)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def header_problem(header) -> str:
    """Why ``header`` is not a well-typed header of this format ("" if it is): the version, size,
    offsets, byte counts and shape entries must be integers (not floats, not booleans)."""
    if not isinstance(header, dict):
        return "its header is not an object"
    if not _is_int(header.get("version")) or header["version"] != FORMAT_VERSION:
        return f"format version {header.get('version')!r}, not {FORMAT_VERSION}"
    if not isinstance(header.get("key"), str) or not _is_int(header.get("size")):
        return "its key or size is not of the right type"
    rows, samples = header.get("table"), header.get("samples")
    if not isinstance(rows, list) or not isinstance(samples, list) or len(samples) != len(rows) \
            or not all(isinstance(s, str) for s in samples):
        return "its table or samples are not lists of the right length"
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("name"), str) or row.get("dtype") not in _DTYPES \
                or not _is_int(row.get("offset")) or not _is_int(row.get("nbytes")) \
                or not isinstance(row.get("shape"), list) or not all(_is_int(n) for n in row["shape"]):
            return "a table row is not of the right types"
    return ""


def _reject(path: Path, why: str, then: str) -> None:
    """Log, once per process, why the file at ``path`` is not used and what happens instead."""
    if why == "missing":
        return
    message = f"the shared weights file {path} is not used: {why}; {then}"
    if message not in _told:
        _told.add(message)
        log.warning(message)


def mapped_if_valid(path: Path, key: str, rows: list[dict], tensors: dict[str, torch.Tensor]
                    ) -> Optional[torch.Tensor]:
    """The whole file mapped copy-on-write as uint8, if it is the file this process wants: its size,
    magic, version, key and table as expected, and every tensor's first and last ``SAMPLE`` bytes
    equal to ``tensors'``. None otherwise (or when it does not exist), the reason logged once."""
    whole, why = checked_mapping(path, key, rows, tensors)
    if whole is None:
        _reject(path, why, "rebuilding it")
    return whole


def checked_mapping(path: Path, key: str, rows: list[dict], tensors: dict[str, torch.Tensor]
                    ) -> tuple[Optional[torch.Tensor], str]:
    """``mapped_if_valid``'s mapping and "", or None and why the file is not the one wanted."""
    header, why = header_of(path)
    if header is None:
        return None, why
    if header["key"] != key or header["table"] != rows:
        return None, "its key or table is not this model's"
    size = header["size"]
    try:
        if size != _end(header, rows) or os.stat(path).st_size != size or size == 0:
            return None, "its size is not where its last tensor ends"
        whole = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:
        return None, f"cannot map it ({exc})"
    start = _data_start({k: v for k, v in header.items() if k != "size"})
    for row, t in zip(rows, tensors.values()):
        own = t.detach().reshape(-1).view(torch.uint8)
        mine = whole[start + row["offset"]:start + row["offset"] + row["nbytes"]]
        n = min(SAMPLE, row["nbytes"])
        if not (torch.equal(own[:n], mine[:n]) and torch.equal(own[-n:], mine[-n:])):
            return None, f"{row['name']} differs from this process's own bytes"
    return whole, ""


def _point_at(tensors: dict[str, torch.Tensor], rows: list[dict], whole: torch.Tensor, start: int) -> None:
    """Every tensor becomes a view of its bytes in ``whole``; its own storage is freed."""
    with torch.no_grad():
        for row, t in zip(rows, tensors.values()):
            lo = start + row["offset"]
            view = whole[lo:lo + row["nbytes"]].view(_DTYPES[row["dtype"]]).view(row["shape"])
            t.set_(view)


def _release_freed_memory() -> None:
    """Give the heap's freed pages (the private copies just dropped) back to the kernel."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
