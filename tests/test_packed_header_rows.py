"""A packed weights file's header rows (``splitserve/models/packed_read.py``): a row whose dtype is
no string (a list, an object) and a table naming one tensor twice are headers "not ours", reported
as such by every reader of the header, never an exception out of ``read_header``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitserve.models import packed_file, packed_read

IDENTITY = {"name": "tiny", "checkpoint": "test"}


@pytest.fixture(autouse=True)
def sharing_on(monkeypatch):
    """Shared weights on, as a worker runs: conftest turns them off for other test files."""
    monkeypatch.setenv(packed_file.ENV_SWITCH, "1")


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8, bias=False)
        self.b = torch.nn.Linear(8, 8, bias=False)


def _written(folder: Path) -> Path:
    return packed_file.share_weights(Two(), identity=IDENTITY, min_bytes=0, cache_dir=folder).path


def _rewrite(path: Path, change) -> None:
    data = path.read_bytes()
    length = int.from_bytes(data[8:16], "little")
    header = change(json.loads(data[16:16 + length]))
    body = json.dumps(header, separators=(",", ":")).encode()
    head = packed_file.MAGIC + len(body).to_bytes(8, "little") + body
    path.write_bytes(head + data[len(head):])


@pytest.mark.parametrize("dtype", [["float32"], {"float32": 1}])
def test_a_dtype_that_is_no_string_is_not_ours_and_raises_nothing(tmp_path, dtype):
    """read_header answers None (not TypeError: unhashable) and the checked read says which row."""
    path = _written(tmp_path)

    def change(header):
        header["table"][0]["dtype"] = dtype
        return header

    _rewrite(path, change)
    assert packed_file.read_header(path) is None
    read = packed_read.read_checked(path, "any key")
    assert read.header is None and "row" in read.why


def test_a_table_naming_a_tensor_twice_is_not_ours():
    """Two rows of one name (which one's bytes would the tensor get?) fail the header's check."""
    row = {"name": "a.weight", "dtype": "float32", "shape": [8, 8], "offset": 0, "nbytes": 256}
    header = {"version": packed_read.FORMAT_VERSION, "key": "k", "size": 0,
              "table": [row, {**row, "offset": 4096}], "crc32": [0, 0]}
    assert packed_read.header_problem(header) == "its table names a tensor twice"
    assert packed_read.header_problem({**header, "table": [row], "crc32": [0]}) == ""
