"""One copy of a model's converted weights per host: a file in the model cache that every worker
on the host maps read-only instead of holding its own copy (README, one copy of the weights).

:func:`share_weights` writes a worker's loaded, packed weights (``layers/linear.py``'s
``shared_tensors``) once to ``$SPLITSERVE_CACHE/packed/NAME-KEY.weights`` and points each tensor at
a private (copy-on-write) mapping of it, so the pages are the page cache's, counted once per host.
The key hashes all that changes the bytes: the checkpoint's identity (``weights_identity``: its
quantization plan, dtype), the kernels' build, every ``.py`` under ``models/`` and ``layers/``, the
``gguf`` and torch versions and the format's version. The format and its checks are
``packed_read.py``'s: a start reads the file once (:func:`attach_file`, in the loader) and hands
that read on (``model.weights_file_read``) to :func:`share_weights`, which reads it again only if
the file changed since. A file is trusted only when its size, magic, version, key and table are
this process's and every tensor matches its checksum (and, where this process loaded its own
copy, its first and last 4 KiB are that copy's); one that fails is rebuilt, with a warning saying
why, by rename under a lock (``cache.write_file_once``). One (or a folder) others can write is
never used (``unsafe_place``).
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
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from splitserve.file_trust import owner_problem, untrusted
from splitserve.models.cache import cache_root, write_file_once
from splitserve.models.packed_read import (ALIGN, DTYPES, FORMAT_VERSION, MAGIC, FileRead, Opener, checksums,
                                           data_start, header_bytes, header_of, map_private, read_checked, still)
from splitserve.models.packed_read import MAX_HEADER  # noqa: F401 -- the format's cap, named here too

log = logging.getLogger(__name__)
_told: set[tuple[str, str]] = set()  # (file, reason) already logged: each once per process

SAMPLE = 4096  # bytes compared at each end of every tensor with this process's own copy
MIN_BYTES = 64 * 2**20  # below this a model's weights are not worth a file (the tiny test models)
ENV_SWITCH = "SPLITSERVE_SHARED_WEIGHTS"


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
            if t.data_ptr() in seen or str(t.dtype).removeprefix("torch.") not in DTYPES:
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
                  cache_dir: Optional[Path] = None, opener: Opener = os.open) -> Shared:
    """Point ``model``'s weight tensors at the host's one file of them (written first if no valid
    one exists). ``identity``: the checkpoint's (default: the loader's ``model.weights_identity``;
    none: nothing is shared); ``min_bytes``: share only models with at least this many bytes of
    weights; ``cache_dir``: the folder of the files (default ``$SPLITSERVE_CACHE/packed``);
    ``opener``: how the file is opened to be read (``os.open``'s shape). The loader's read of the
    file (``attach_file``) is used, not repeated, while the file is still the one it read."""
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
    read = getattr(model, "weights_file_read", None)
    model.weights_file_read = None  # what it mapped is ours below, or dropped
    if read is None or read.path != path or not still(read):
        read = read_checked(path, key, opener)
    elif getattr(model, "weights_file", None) == path and read.header is not None and read.header["table"] == rows:
        return Shared(path, total, private)  # the loader mapped it: nothing to write or point
    try:
        whole, wrote, start = _reuse_or_write(read, key, rows, tensors, opener)
    except OSError as exc:  # a full disk, a read-only cache: serve from our own copy
        log.warning("cannot write the shared weights file %s (%s); this worker keeps its own copy", path, exc)
        return Shared(None, 0, total + private)
    _point_at(tensors, rows, whole, start)
    _release_freed_memory()
    if wrote:
        remove_older(path)
    log.info("weights: %.1f MiB mapped from %s (%s); %.1f MiB private", total / 2**20, path,
             "written" if wrote else "reused", private / 2**20)
    return Shared(path, total, private, wrote)


def _reuse_or_write(read: FileRead, key: str, rows: list[dict], tensors: dict[str, torch.Tensor],
                    opener: Opener) -> tuple[torch.Tensor, bool, int]:
    """The file of ``read`` mapped, if it holds ``tensors``' bytes; else a new one written under the
    lock (``cache.write_file_once``) and mapped as written. Before and under the lock the file is
    read again only where it changed since ``read`` (another worker wrote it meanwhile). Returns
    the mapping, whether this call wrote it, and where its tensors begin."""
    state = {"read": read, "whole": None, "start": 0}

    def valid(path: Path) -> bool:
        if not still(state["read"]):
            state["read"] = read_checked(path, key, opener)
        whole, why = _holds(state["read"], rows, tensors)
        if whole is None:
            _reject(path, why, "rebuilding it")
            return False
        state["whole"], state["start"] = whole, state["read"].start()
        return True

    def write(f) -> None:
        header = {"version": FORMAT_VERSION, "key": key, "table": rows,
                  "crc32": checksums([_bytes_of(t) for t in tensors.values()])}
        write_tensors(f, header, tensors)
        f.flush()
        size = f.seek(0, os.SEEK_END)
        state["whole"], state["start"] = map_private(f.fileno(), size), data_start(header)  # what we wrote

    wrote = write_file_once(read.path, write, valid)
    return state["whole"], wrote, state["start"]


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


def attach_file(model: torch.nn.Module, identity: dict, ops, cache_dir: Optional[Path] = None,
                opener: Opener = os.open) -> Optional[Shared]:
    """Give a model just made (not loaded) its weights from the host's file, if a valid one holds
    exactly what it needs (``shared_shapes``; every other module's parameters): the file read and
    checked once (``packed_read.read_checked``: owner, header, size, layout, every tensor's checksum).
    None, having changed nothing, where there is none, it does not fit or fails a check, or
    ``SPLITSERVE_SHARED_WEIGHTS`` is off. ``ops``: the compiled kernels the quantized layers run
    on; ``opener``: how the file is opened. The read is left on the model (``weights_file_read``)
    for ``share_weights``, which then need not read the file again."""
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
    read = model.weights_file_read = read_checked(path, key, opener)
    if read.header is None or {r["name"]: (r["dtype"], r["shape"]) for r in read.header["table"]} != needed:
        _reject(path, read.why or "its table is not this model's tensors", "loading the checkpoint (it is rebuilt)")
        return None
    rows = read.header["table"]
    for row, view in zip(rows, read.views()):
        prefix, _, attr = row["name"].rpartition(".")
        view = view.view(DTYPES[row["dtype"]]).view(row["shape"])
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


def _holds(read: FileRead, rows: list[dict], tensors: dict[str, torch.Tensor]) -> tuple[Optional[torch.Tensor], str]:
    """``read``'s mapping and "", if its file holds ``tensors`` laid out as ``rows`` (its first and
    last ``SAMPLE`` bytes of each equal to this process's own, its checksums checked when read);
    else None and why not."""
    if read.header is None:
        return None, read.why
    if read.header["table"] != rows:
        return None, "its table is not this model's tensors"
    for row, t, mine in zip(rows, tensors.values(), read.views()):
        own = _bytes_of(t)
        n = min(SAMPLE, row["nbytes"])
        if not (torch.equal(own[:n], mine[:n]) and torch.equal(own[-n:], mine[-n:])):
            return None, f"{row['name']} differs from this process's own bytes"
    return read.whole, ""


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60] or "model"


def write_tensors(f, header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write the file to the open binary file ``f``: magic, header, each tensor at its offset."""
    start = data_start(header)
    rows = header["table"]
    end = start + (rows[-1]["offset"] + rows[-1]["nbytes"] if rows else 0)
    body = header_bytes({**header, "size": end})
    f.write(MAGIC + struct.pack("<Q", len(body)) + body)
    for row, t in zip(rows, tensors.values()):
        f.seek(start + row["offset"])
        f.write(_bytes_of(t).numpy().data)
    f.truncate(end)


def read_header(path: Path) -> Optional[dict]:
    """The file's header, or None where the file is not one of ours (``packed_read.header_of`` says why)."""
    return header_of(path)[0]


def unsafe_place(path: Path, uid: Optional[int] = None) -> str:
    """Why the file at ``path`` or its folder must not be used ("" if they may): one that another
    user owns or that group or others may write (whoever can write it can make any change pass
    the checks, the checksums being in its header), or a folder where the file belongs (not
    removed: it is not ours to delete). ``uid``: whose they must be (default: ours)."""
    if path.is_dir():  # follows a symlink, as opening it would
        return f"{path} is a folder, not a weights file (remove it to share the weights)"
    return untrusted([path.parent, path], uid)


def _reject(path: Path, why: str, then: str) -> None:
    """Log, once per process and reason, why the file at ``path`` is not used and what happens
    instead (the loader's "loading the checkpoint (it is rebuilt)" stands for sharing's rebuild)."""
    if why == "missing" or (str(path), why) in _told:
        return
    _told.add((str(path), why))
    log.warning(f"the shared weights file {path} is not used: {why}; {then}")


def _point_at(tensors: dict[str, torch.Tensor], rows: list[dict], whole: torch.Tensor, start: int) -> None:
    """Every tensor becomes a view of its bytes in ``whole``; its own storage is freed."""
    with torch.no_grad():
        for row, t in zip(rows, tensors.values()):
            lo = start + row["offset"]
            view = whole[lo:lo + row["nbytes"]].view(DTYPES[row["dtype"]]).view(row["shape"])
            t.set_(view)


def _release_freed_memory() -> None:
    """Give the heap's freed pages (the private copies just dropped) back to the kernel."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
