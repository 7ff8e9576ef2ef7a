"""A small model to pack and share (``Tiny``, ``IDENTITY``) and ``sharing_on``, an autouse fixture
that turns shared weights on as a worker runs (conftest turns them off for other test files):
import it into a test module of the packed weights file to use it there."""

from __future__ import annotations

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
