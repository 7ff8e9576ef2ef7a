"""The shared packed-weights file read once per start, damage inside a tensor caught, and the model
cache's folders trusted only when they are ours alone (``models/packed_file.py``,
``models/packed_read.py``, ``models/cache.py``'s ``build_once``, ``file_trust.py``).

A start is what a worker does: the loader's ``attach_file``, then the runner's ``share_weights``;
the file's reads are counted through their ``opener`` parameter."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from conftest import CACHE_DIR
from helpers.packed_models import IDENTITY, Tiny, sharing_on  # noqa: F401 (an autouse fixture)
from splitserve.models import cache, packed_file


class Opens:
    """An ``opener`` that counts the opens of the weights file."""

    def __init__(self):
        self.count = 0

    def __call__(self, path, flags):
        self.count += str(path).endswith(".weights")
        return os.open(path, flags)


def _start(folder: Path, opener) -> packed_file.Shared:
    """A worker's start on the one-layer module: attach the file if it fits, else 'load', then share."""
    model = Tiny().requires_grad_(False)
    packed_file.attach_file(model, IDENTITY, None, cache_dir=folder, opener=opener)
    return packed_file.share_weights(model, identity=IDENTITY, min_bytes=0, cache_dir=folder, opener=opener)


def _flip(path: Path, where: int) -> None:
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))


def _middle_of(path: Path, name: str) -> int:
    """The file offset of the byte in the middle of tensor ``name`` (a float32's top byte)."""
    header = packed_file.read_header(path)
    row = next(r for r in header["table"] if r["name"] == name)
    start = header["size"] - header["table"][-1]["offset"] - header["table"][-1]["nbytes"]
    return start + row["offset"] + (row["nbytes"] // 2 // 4) * 4 + 3


def _damage_inside(path: Path) -> None:
    _flip(path, _middle_of(path, "lin.weight"))


def _bad_magic(path: Path) -> None:
    _flip(path, 0)


@pytest.mark.parametrize("before", ["missing", "valid", "damaged inside", "bad magic"])
def test_a_start_reads_the_file_once(tmp_path, before):
    """Whether the file is missing, valid, damaged inside a tensor or not ours, one start (attach
    then share) opens and reads it once: the loader's read is handed on, and under the lock it is
    not read again while the file is unchanged. Each ends with a valid file."""
    if before != "missing":
        packed_file.share_weights(Tiny(), identity=IDENTITY, min_bytes=0, cache_dir=tmp_path)
        path = packed_file.file_path(IDENTITY, tmp_path)[0]
        {"valid": lambda p: None, "damaged inside": _damage_inside, "bad magic": _bad_magic}[before](path)
    opens = Opens()
    shared = _start(tmp_path, opens)
    assert opens.count == 1
    assert shared.path is not None and shared.rebuilt == (before != "valid")
    again = Opens()
    assert not _start(tmp_path, again).rebuilt and again.count == 1


def test_a_file_replaced_after_the_loader_read_it_is_read_again(tmp_path):
    """Between attach and share another worker replaces the file: share sees by its identity that
    it changed, reads it again (twice in all) and maps the new one, writing nothing."""
    packed_file.share_weights(Tiny(), identity=IDENTITY, min_bytes=0, cache_dir=tmp_path)
    path = packed_file.file_path(IDENTITY, tmp_path)[0]
    model = Tiny().requires_grad_(False)
    opens = Opens()
    assert packed_file.attach_file(model, IDENTITY, None, cache_dir=tmp_path, opener=opens) is not None
    copy = tmp_path / "copy"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # a new inode, the same bytes
    shared = packed_file.share_weights(model, identity=IDENTITY, min_bytes=0, cache_dir=tmp_path, opener=opens)
    assert opens.count == 2 and shared.path == path and not shared.rebuilt
    assert model.lin.weight.untyped_storage().nbytes() == path.stat().st_size  # the new file's mapping


def _worker(model_dir: Path):
    """A start of a worker on the tiny model (its loader, the file shared at any size) and the
    tokens it generates greedily for a fixed prompt."""
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine, ModelParts
    from splitserve.engine.io import GenerateRequest, SamplingParams
    from splitserve.models.loader import load_model, load_tokenizer

    model, spec = load_model(model_dir, dtype="float32", quantization="none", kernels=None)
    shared = packed_file.share_weights(model, min_bytes=0)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_total_tokens=64, page_size=4),
                       ModelParts(model, spec, load_tokenizer(model_dir)))
    out = engine.generate([GenerateRequest("r", (5, 17, 33, 9), SamplingParams(temperature=0.0, max_tokens=8))])
    return shared, out["r"].token_ids


def test_damage_inside_a_tensor_is_rebuilt_and_serves_the_same_tokens(tmp_path, monkeypatch, caplog):
    """One byte flipped in the middle of a tensor of the tiny model's file (outside its first and
    last 4 KiB): the next start does not map it, rebuilds it saying which tensor and why, and
    generates the tokens the first start generated; the start after maps the rebuilt file."""
    from splitserve.testing.tiny import tiny_model_path

    monkeypatch.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
    model_dir = tiny_model_path("llama")
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))  # the packed file's cache: empty
    first, tokens = _worker(model_dir)
    assert first.rebuilt
    name = "model.layers.0.mlp.down_proj.weight"
    _flip(first.path, _middle_of(first.path, name))
    with caplog.at_level(logging.WARNING, logger=packed_file.__name__):
        second, again = _worker(model_dir)
    assert second.path == first.path and second.rebuilt and again == tokens
    told = [r.getMessage() for r in caplog.records if str(first.path) in r.getMessage()]
    assert len(told) == 1 and name in told[0] and "checksum" in told[0], told
    third, still = _worker(model_dir)
    assert not third.rebuilt and still == tokens


def _complete(path: Path) -> bool:
    return (path / "marker").is_file()


def _plant(final: Path, how: str, elsewhere: Path) -> None:
    """A complete-looking folder at ``final`` that is not ours alone."""
    target = elsewhere if how == "symlink" else final
    target.mkdir(parents=True)
    (target / "marker").write_text("planted")
    if how == "symlink":
        final.symlink_to(target)
    elif how == "world-writable":
        os.chmod(final, 0o777)
    elif how == "group-writable file":
        os.chmod(final / "marker", 0o664)
    else:
        os.chown(final / "marker", 65534, 65534)
        os.chown(final, 65534, 65534)


@pytest.mark.parametrize("how", ["world-writable", "other owner", "symlink", "group-writable file"])
def test_build_once_never_uses_a_folder_others_own_or_may_write(tmp_path, how, caplog):
    """A complete folder with mode 777, owned by another user (nobody), that is a symlink to a
    folder elsewhere, or holding a file its group may write is not used: it is rebuilt in place,
    with a warning naming it, and what a symlink pointed to is left as it was."""
    if how == "other owner" and os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    final = tmp_path / "cache" / "model"
    elsewhere = tmp_path / "elsewhere"
    final.parent.mkdir(mode=0o755)
    _plant(final, how, elsewhere)
    with caplog.at_level(logging.WARNING, logger=cache.__name__):
        got = cache.build_once(final, lambda tmp: (tmp / "marker").write_text("built"), _complete)
    assert got == final and not final.is_symlink() and (final / "marker").read_text() == "built"
    assert final.stat().st_uid == os.geteuid() and final.stat().st_mode & 0o777 == 0o755
    assert (final / "marker").stat().st_mode & 0o022 == 0
    assert any(str(final) in r.getMessage() and "not used" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in final.parent.iterdir()) == [".model.lock", "model"]  # nothing left aside
    if how == "symlink":
        assert (elsewhere / "marker").read_text() == "planted"


def test_build_once_refuses_a_cache_folder_others_may_write(tmp_path):
    """Where the folder that holds it may be written by others, nothing is built or used: the
    error names the folder and the fix, and the builder never runs."""
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)
    built = []
    with pytest.raises(cache.UntrustedCache) as refused:
        cache.build_once(parent / "model", built.append, _complete)
    assert str(parent) in str(refused.value) and "chmod go-w" in str(refused.value)
    assert "SPLITSERVE_CACHE" in str(refused.value) and not built and not (parent / "model").exists()


def test_a_built_folder_is_writable_by_its_owner_only_whatever_the_umask(tmp_path):
    """Files a builder writes under a umask of 002 lose group write, so the folder is usable."""
    old = os.umask(0o002)
    try:
        final = cache.build_once(tmp_path / "model", lambda tmp: (tmp / "marker").write_text("x"), _complete)
    finally:
        os.umask(old)
    assert (final / "marker").stat().st_mode & 0o777 == 0o644
    assert cache.build_once(final, lambda tmp: pytest.fail("rebuilt"), _complete) == final
