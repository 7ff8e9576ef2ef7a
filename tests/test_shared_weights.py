"""The host's one copy of the packed weights (``splitserve/models/packed_file.py``): a model's
weights point at a file in the cache that is written once, reused, checked, rebuilt when broken,
and mapped by several processes as shared pages (``/proc/PID/smaps``).

On the small Llama 3.2 test shape (``make-model``), quantized to Q4_1/Q8_0 at load (``int4``) when
the compiled kernels build here, else in float32 (plain parameters)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.models import packed_file
from splitserve.models.loader import load_model
from splitserve.models.make_model import make_model
from conftest import CACHE_DIR

CHILD = """
import sys, torch
torch.set_num_threads(1)
from splitserve.models.loader import load_model
from splitserve.models.packed_file import model_tensors, share_weights
kernels = None
if sys.argv[2] != "none":
    from splitserve.layers import kernels as compiled
    kernels = compiled.load(force=True)
model, spec = load_model(sys.argv[1], dtype="float32", quantization=sys.argv[2], kernels=kernels)
shared = share_weights(model, min_bytes=0, cache_dir=sys.argv[3])
assert shared.path is not None, shared
for t in model_tensors(model)[0].values():
    t.reshape(-1).view(torch.uint8)[::4096].sum()
print("ready", shared.path, int(shared.rebuilt), flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shape")
    return make_model("llama-3.2-test", out, gguf_types=(), hf=True)["hf"]


@pytest.fixture(scope="module")
def kernels():
    from splitserve.layers import kernels as compiled

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
        return compiled.load(force=True)


def _load(folder, kernels):
    return load_model(folder, dtype="float32", quantization="int4" if kernels else "none", kernels=kernels)


def _logits(model, spec) -> torch.Tensor:
    """The logits of three fixed rows, then every projection's output on fixed rows, concatenated."""
    from splitserve.layers.linear import Linear

    rows = lambda n: torch.linspace(-1, 1, 3 * n).reshape(3, n).to(spec.dtype)  # noqa: E731
    outputs = [model.compute_logits(rows(spec.hidden_size)).flatten()]
    for m in model.modules():
        if isinstance(m, Linear):
            outputs.append(m(rows(m.in_features)).float().flatten())
    return torch.cat(outputs)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """The model cache (the shared files under ``packed/``), empty."""
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(autouse=True)
def sharing_on(monkeypatch):
    """Shared weights on, as a worker runs: conftest turns them off for every other test file."""
    monkeypatch.setenv(packed_file.ENV_SWITCH, "1")


def _in_file(model, path: Path) -> bool:
    tensors, _ = packed_file.model_tensors(model)
    return bool(tensors) and all(t.untyped_storage().nbytes() == path.stat().st_size for t in tensors.values())


def _mappings(model) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in packed_file.model_tensors(model)[0].values()}


def test_weights_are_written_once_then_mapped_with_the_same_results(folder, kernels, cache):
    """The first load writes the file and every weight becomes a view of it, the results unchanged;
    a second load maps it instead of loading the checkpoint, and sharing then writes nothing."""
    model, spec = _load(folder, kernels)
    before = _logits(model, spec)
    first = packed_file.share_weights(model, min_bytes=0)
    assert first.rebuilt and first.path.is_file() and first.mapped_bytes > 0 and first.private_bytes == 0
    assert _in_file(model, first.path)  # all in the one mapping
    if kernels:
        assert any(name.endswith(".quant") for name in packed_file.model_tensors(model)[0])  # the packed blocks
    assert torch.equal(_logits(model, spec), before)

    again, _ = _load(folder, kernels)
    assert _in_file(again, first.path)  # mapped by the loader, the checkpoint not read
    assert torch.equal(_logits(again, spec), before)
    mapping = _mappings(again)
    second = packed_file.share_weights(again, min_bytes=0)
    assert second.path == first.path and not second.rebuilt
    assert _mappings(again) == mapping  # the loader's mapping kept, not mapped twice
    assert torch.equal(_logits(again, spec), before)
    assert [p.name for p in first.path.parent.iterdir() if not p.name.startswith(".")] == [first.path.name]


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def _bad_magic(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"NOTMINE!")


def _flip(path: Path, first: bool) -> None:
    """One byte of the first tensor's first 4 KiB (or the last one's last) inverted."""
    header = packed_file.read_header(path)
    end = path.stat().st_size
    where = end - header["table"][-1]["offset"] - header["table"][-1]["nbytes"] if first else end - 1
    with open(path, "r+b") as f:  # the data starts where the last tensor's offset says, counted back
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))


def _flip_first_tensor_byte(path: Path) -> None:
    _flip(path, first=True)


def _flip_last_tensor_byte(path: Path) -> None:
    _flip(path, first=False)


def _other_version(path: Path) -> None:
    data = path.read_bytes().replace(f'"version":{packed_file.FORMAT_VERSION}'.encode(), b'"version":7', 1)
    path.write_bytes(data)


@pytest.mark.parametrize("damage", [_truncate, _bad_magic, _flip_first_tensor_byte, _flip_last_tensor_byte,
                                    _other_version])
def test_a_broken_file_is_rebuilt_never_trusted(folder, kernels, cache, damage):
    """A file cut short, not one of ours, holding other bytes, or of another format version is
    neither mapped by the loader nor by sharing: it is replaced by a good one, and the model
    computes what it computed before."""
    model, spec = _load(folder, kernels)
    before = _logits(model, spec)
    path = packed_file.share_weights(model, min_bytes=0).path
    damage(path)
    again, _ = _load(folder, kernels)
    assert not _in_file(again, path)  # the loader read the checkpoint
    assert torch.equal(_logits(again, spec), before)
    shared = packed_file.share_weights(again, min_bytes=0)
    assert shared.path == path and shared.rebuilt
    assert torch.equal(_logits(again, spec), before)
    assert packed_file.read_header(path)["size"] == path.stat().st_size
    third, _ = _load(folder, kernels)
    assert _in_file(third, path) and torch.equal(_logits(third, spec), before)


def test_a_file_without_every_weight_the_model_needs_is_not_mapped_at_load(folder, cache):
    """bfloat16 projections packed by oneDNN stay private, so their model's file holds only the
    embedding and the norms: a later load of the same model reads the checkpoint instead."""
    from splitserve.layers.linear import packing_available

    if not packing_available(torch.bfloat16, "cpu"):
        pytest.skip("oneDNN bf16 packing unavailable: every weight is in the file")
    model, spec = load_model(folder, dtype="bfloat16", quantization="none", kernels=None)
    before = _logits(model, spec)
    model.pack_weights()
    shared = packed_file.share_weights(model, min_bytes=0)
    assert shared.path is not None and shared.private_bytes > shared.mapped_bytes > 0
    names = {row["name"] for row in packed_file.read_header(shared.path)["table"]}
    assert "model.embed_tokens.weight" in names and not any("proj" in name for name in names)
    again, _ = load_model(folder, dtype="bfloat16", quantization="none", kernels=None)
    assert not _in_file(again, shared.path)
    assert torch.equal(_logits(again, spec), before)


def test_nothing_is_shared_when_switched_off_or_below_the_size(folder, kernels, tmp_path, monkeypatch):
    """Below ``min_bytes``, without an identity or with SPLITSERVE_SHARED_WEIGHTS=0 no file is made."""
    model, _ = _load(folder, kernels)
    assert packed_file.share_weights(model, cache_dir=tmp_path).path is None  # a test shape: below the default
    assert packed_file.share_weights(model, identity=None, min_bytes=0, cache_dir=tmp_path).path is not None
    del model.weights_identity
    assert packed_file.share_weights(model, min_bytes=0, cache_dir=tmp_path / "b").path is None
    model, _ = _load(folder, kernels)
    monkeypatch.setenv(packed_file.ENV_SWITCH, "0")
    assert packed_file.share_weights(model, min_bytes=0, cache_dir=tmp_path / "c").path is None


def mapping_memory(pid: int, path: Path) -> tuple[int, int]:
    """(RSS, PSS) in KiB of ``pid``'s mappings of ``path`` (``/proc/PID/smaps``)."""
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = line.endswith(str(path))
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1])
        elif inside and fields[0] == "Pss:":
            pss += int(fields[1])
    return rss, pss


def _touch(model) -> None:
    for t in packed_file.model_tensors(model)[0].values():  # every page read, as serving would
        t.reshape(-1).view(torch.uint8)[::4096].sum()


def test_two_processes_share_the_weight_pages(folder, kernels, tmp_path):
    """Two processes (a child and this one) that load the same model at once map one file, which
    exactly one of them wrote: each one's PSS of the mapping is about half its RSS, and the RSS is
    all the weights."""
    env = dict(os.environ, SPLITSERVE_CACHE=str(CACHE_DIR), SPLITSERVE_KERNELS="1" if kernels else "0",
               SPLITSERVE_SHARED_WEIGHTS="1")
    argv = [sys.executable, "-c", CHILD, str(folder), "int4" if kernels else "none", str(tmp_path)]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        model, _ = _load(folder, kernels)
        mine = packed_file.share_weights(model, min_bytes=0, cache_dir=tmp_path)
        _touch(model)
        line = child.stdout.readline().split()
        assert line[:2] == ["ready", str(mine.path)], line
        assert int(line[2]) + int(mine.rebuilt) == 1  # one wrote, the other waited and mapped it
        weights_kib = (mine.path.stat().st_size - 4096) // 1024
        for pid in (child.pid, os.getpid()):
            rss, pss = mapping_memory(pid, mine.path)
            assert rss >= 0.9 * weights_kib, (rss, weights_kib)
            assert pss <= 0.6 * rss, (pss, rss)  # half each, give or take the header page
    finally:
        child.communicate("\n", timeout=60)


def test_an_unwritable_cache_leaves_the_weights_private(folder, kernels, tmp_path):
    """Where the file cannot be written (its folder is a file here) the worker keeps its own copy."""
    model, spec = _load(folder, kernels)
    before = _logits(model, spec)
    (tmp_path / "taken").write_text("")
    shared = packed_file.share_weights(model, min_bytes=0, cache_dir=tmp_path / "taken")
    assert shared.path is None and shared.mapped_bytes == 0 and shared.private_bytes > 0
    assert torch.equal(_logits(model, spec), before)
