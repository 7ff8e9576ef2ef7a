"""The shared packed-weights file (``splitserve/models/packed_file.py``, ``models/cache.py``) against
a hostile or damaged cache: what its key covers, headers of the wrong types, files that are not
regular files, locks that are symlinks, folders where files belong, permissions others could
abuse. Unit-level, on a one-layer module's weights in a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.models import packed_file

IDENTITY = {"name": "tiny", "checkpoint": "test"}


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(64, 64)


@pytest.fixture(autouse=True)
def sharing_on(monkeypatch):
    """Shared weights on, as a worker runs: conftest turns them off for other test files."""
    monkeypatch.setenv(packed_file.ENV_SWITCH, "1")


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
