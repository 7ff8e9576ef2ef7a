"""The shared packed-weights file (``splitserve/models/packed_file.py``, ``models/cache.py``) against
a hostile or damaged cache: what its key covers, headers of the wrong types, files that are not
regular files, locks that are symlinks, folders where files belong, permissions others could
abuse. Unit-level, on a one-layer module's weights in a temporary folder."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from helpers.packed_models import IDENTITY, Tiny, sharing_on  # noqa: F401 (an autouse fixture)
from splitserve.models import cache, packed_file


def _share(model: torch.nn.Module, folder: Path) -> packed_file.Shared:
    return packed_file.share_weights(model, identity=IDENTITY, min_bytes=0, cache_dir=folder)


def test_the_key_covers_the_converting_code_and_the_gguf_version(tmp_path):
    """Two keys differ when only the converting code's digest or only the gguf version differs, and
    the digest changes when one source file under its folders changes."""
    base = packed_file.file_key(IDENTITY, "build", "code-a", "0.19.0")
    assert packed_file.file_key(IDENTITY, "build", "code-a", "0.19.0") == base
    assert packed_file.file_key(IDENTITY, "build", "code-b", "0.19.0") != base
    assert packed_file.file_key(IDENTITY, "build", "code-a", "0.20.0") != base
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "quant.py").write_text("SCALE = 1\n")
    (tmp_path / "linear.py").write_text("PACK = 1\n")
    before = packed_file.code_digest([tmp_path])
    (tmp_path / "sub" / "quant.py").write_text("SCALE = 2\n")
    assert packed_file.code_digest([tmp_path]) != before


def _rewrite_header(path: Path, change) -> None:
    """The file's header JSON replaced by ``change(header)`` (a dict, or raw bytes), its tensors kept."""
    data = path.read_bytes()
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + length])
    body = change(header)
    body = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    head = packed_file.MAGIC + len(body).to_bytes(8, "little") + body
    path.write_bytes(head + data[len(head):] if len(head) < 4096 else head)


def _floats(header):
    for row in header["table"]:
        row["offset"] = float(row["offset"])
    return header


def _float_shape(header):
    header["table"][0]["shape"] = [float(n) for n in header["table"][0]["shape"]]
    return header


def _float_size(header):
    return {**header, "size": float(header["size"])}


def _bool_version(header):
    return {**header, "version": True}


def _deep(header):
    return b"[" * 200_000 + b"]" * 200_000


def _table_object(header):
    return {**header, "table": {"a": 1}}


@pytest.mark.parametrize("change", [_floats, _float_shape, _float_size, _bool_version, _deep, _table_object])
def test_a_header_of_the_wrong_types_is_rebuilt_never_a_crash(tmp_path, change, caplog):
    """Float offsets, shapes or size, a boolean version, JSON nested too deep for the parser, a table
    that is no list: the loader does not map the file, sharing rebuilds it, nothing raises, and the
    log names the file and why it was not used."""
    model = Tiny()
    path = _share(model, tmp_path).path
    _rewrite_header(path, change)
    fresh = Tiny(seed=1).requires_grad_(False)
    with caplog.at_level(logging.WARNING, logger=packed_file.__name__):
        assert packed_file.attach_file(fresh, IDENTITY, None, cache_dir=tmp_path) is None
        assert not torch.equal(fresh.lin.weight, model.lin.weight)
        shared = _share(fresh, tmp_path)
    assert shared.path == path and shared.rebuilt
    assert any(str(path) in r.getMessage() and "not used" in r.getMessage() for r in caplog.records)
    assert packed_file.attach_file(Tiny(seed=2), IDENTITY, None, cache_dir=tmp_path) is not None


def _within(seconds: float, call):
    """``call()``'s result, run on a thread given ``seconds`` (a hang fails the test, not the suite)."""
    out = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, "hung"
    return out[0]


def test_a_fifo_at_the_file_or_the_lock_does_not_hang(tmp_path, caplog):
    """A FIFO at the file's path is not a weights file: the loader reads the checkpoint and sharing
    writes a real file over it. A FIFO at the lock's path leaves the worker its own copy, logged."""
    path = packed_file.file_path(IDENTITY, tmp_path)[0]
    os.mkfifo(path)
    assert _within(20, lambda: packed_file.attach_file(Tiny(), IDENTITY, None, cache_dir=tmp_path)) is None
    shared = _within(20, lambda: _share(Tiny(), tmp_path))
    assert shared.path == path and shared.rebuilt and path.is_file()
    other = packed_file.file_path({**IDENTITY, "name": "other"}, tmp_path)[0]
    os.mkfifo(tmp_path / f".{other.name}.lock")
    with caplog.at_level(logging.WARNING, logger=packed_file.__name__):
        shared = _within(20, lambda: packed_file.share_weights(Tiny(), identity={**IDENTITY, "name": "other"},
                                                                 min_bytes=0, cache_dir=tmp_path))
    assert shared.path is None and shared.mapped_bytes == 0 and not other.exists()
    assert any("lock" in r.getMessage() for r in caplog.records)


def test_a_symlink_at_a_lock_is_not_followed(tmp_path):
    """A lock path that is a symlink to another file (write_file_once's and build_once's) is refused
    with OSError, and the symlink's target keeps its bytes; an existing lock file is not emptied."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    final = tmp_path / "out.weights"
    (tmp_path / ".out.weights.lock").symlink_to(victim)
    with pytest.raises(OSError):
        cache.write_file_once(final, lambda f: f.write(b"x"), lambda p: False)
    (tmp_path / ".built.lock").symlink_to(victim)
    with pytest.raises(OSError):
        cache.build_once(tmp_path / "built", lambda d: None, lambda p: False)
    assert victim.read_text() == "precious" and not final.exists()
    (tmp_path / ".kept.lock").write_text("note")
    assert cache.write_file_once(tmp_path / "kept", lambda f: f.write(b"x"), lambda p: p.exists())
    assert (tmp_path / ".kept.lock").read_text() == "note" and (tmp_path / "kept").read_bytes() == b"x"


@pytest.mark.parametrize("what", ["folder", "file"])
def test_a_file_or_folder_others_may_write_is_never_used(tmp_path, what, caplog):
    """A file, or its folder, writable by group or others is neither mapped nor written: the worker
    keeps its own copy, logging why; one owned by another user is refused the same way."""
    folder = tmp_path / "packed"
    path = _share(Tiny(), folder).path
    before = path.read_bytes()
    os.chmod(folder if what == "folder" else path, 0o777 if what == "folder" else 0o666)
    fresh = Tiny(seed=1).requires_grad_(False)
    with caplog.at_level(logging.WARNING, logger=packed_file.__name__):
        assert packed_file.attach_file(fresh, IDENTITY, None, cache_dir=folder) is None
        shared = _share(fresh, folder)
    assert shared.path is None and shared.mapped_bytes == 0 and path.read_bytes() == before
    assert fresh.lin.weight.untyped_storage().nbytes() == 64 * 64 * 4  # its own copy, not the file
    assert any("writable by group or others" in r.getMessage() for r in caplog.records)
    os.chmod(folder, 0o755)
    os.chmod(path, 0o644)
    assert packed_file.unsafe_place(path) == ""
    assert "owned by user" in packed_file.unsafe_place(path, uid=os.geteuid() + 1)


def test_a_header_longer_than_the_cap_is_not_parsed(tmp_path, caplog):
    """A well-formed header padded past ``MAX_HEADER`` (4 MiB) is rejected by its length, and rebuilt."""
    path = _share(Tiny(), tmp_path).path
    _rewrite_header(path, lambda header: {**header, "pad": "x" * packed_file.MAX_HEADER})
    with caplog.at_level(logging.WARNING, logger=packed_file.__name__):
        assert packed_file.read_header(path) is None
        assert _share(Tiny(), tmp_path).rebuilt
    assert any("a header of" in r.getMessage() for r in caplog.records)


def test_folders_at_the_file_or_temporary_paths_do_not_turn_sharing_off(tmp_path, caplog):
    """A folder left where a temporary file goes is skipped (the file is still written); a folder at
    the file's own path is logged, kept, and the worker keeps its own copy."""
    path = packed_file.file_path(IDENTITY, tmp_path)[0]
    tmp_path.mkdir(exist_ok=True)
    leftover = tmp_path / f".{path.name}.tmp-old"
    (leftover / "inside").mkdir(parents=True)
    assert _share(Tiny(), tmp_path).rebuilt and path.is_file() and (leftover / "inside").is_dir()
    other = packed_file.file_path({**IDENTITY, "name": "other"}, tmp_path)[0]
    (other / "inside").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger=packed_file.__name__):
        shared = packed_file.share_weights(Tiny(), identity={**IDENTITY, "name": "other"}, min_bytes=0,
                                           cache_dir=tmp_path)
    assert shared.path is None and (other / "inside").is_dir()
    assert any(f"{other} is a folder" in r.getMessage() for r in caplog.records)


def test_a_rebuild_says_why_once(tmp_path, caplog):
    """A file whose tensor bytes differ from the worker's own is rebuilt with one warning naming the
    file and the tensor, though it is checked before and again under the lock."""
    path = _share(Tiny(), tmp_path).path
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=packed_file.__name__):
        assert _share(Tiny(), tmp_path).rebuilt
    told = [r.getMessage() for r in caplog.records if "differs" in r.getMessage()]
    assert len(told) == 1 and str(path) in told[0] and "lin.bias" in told[0] and "rebuilding" in told[0]


def test_a_killed_kernels_builds_lock_is_removed_under_our_lock(tmp_path, caplog):
    """torch's ``lock`` file left in a kernels build folder (its builder killed) is removed, with a
    warning naming it, once our own lock on the folder is held; while held, that lock is taken."""
    from splitserve.layers import kernels

    (tmp_path / "lock").write_text("")
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        with kernels.build_lock(tmp_path):
            assert not (tmp_path / "lock").exists()
            with open(tmp_path / "splitserve.lock", "rb") as other, pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert any(str(tmp_path / "lock") in r.getMessage() for r in caplog.records)
    with kernels.build_lock(tmp_path):  # nothing planted: nothing to say
        pass


def test_a_new_file_removes_its_models_older_files_only(tmp_path):
    """One file per model, not one per build ever run: the older keys of the same model go; another
    model's files (even one whose name starts with this one's), other files and links stay."""
    from splitserve.models.packed_file import remove_older

    key = lambda c: c * 20  # noqa: E731 (20 hex digits)
    new = tmp_path / f"llama-3.2-1b-{key('a')}.weights"
    older = tmp_path / f"llama-3.2-1b-{key('b')}.weights"
    other_model = tmp_path / f"llama-3.2-1b-q4_0-{key('c')}.weights"
    unrelated = tmp_path / "llama-3.2-1b-notes.txt"
    for f in (new, older, other_model, unrelated):
        f.write_bytes(b"x")
    link = tmp_path / f"llama-3.2-1b-{key('d')}.weights"
    link.symlink_to(unrelated)
    assert remove_older(new) == [older]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (new, other_model, unrelated, link))
