"""What a worker maps or loads from its cache must be its own and writable by no one else: the
owner and mode rules (``file_trust.py``), and the compiled kernels refused (the PyTorch ops used,
with a warning naming the folder) where others could write the shared library it would load."""

import os
import subprocess
import sys

from splitserve.file_trust import untrusted


def test_a_path_others_may_write_or_own_is_named(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    assert untrusted([mine, tmp_path / "absent"]) == ""
    os.chmod(mine, 0o775)
    assert "writable by group or others (mode 775)" in untrusted([mine])
    os.chmod(mine, 0o755)
    assert "owned by user" in untrusted([mine], uid=os.geteuid() + 1)


def test_kernels_in_a_folder_others_may_write_are_not_loaded(tmp_path):
    """Before: the library in a world-writable cache was built there and loaded (their code in
    the worker). The refusal comes before any build, so this takes no compiler time."""
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True)
    os.chmod(cache, 0o755)
    os.chmod(cache / "kernels", 0o777)
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from splitserve.layers import kernels\nprint('ops:', kernels.load(force=True))")
    env = {**os.environ, "SPLITSERVE_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "ops: None" in run.stdout
    assert "not loaded" in run.stderr and "kernels is writable by group or others (mode 777)" in run.stderr
    assert not list((cache / "kernels").glob("*/*.so"))  # nothing built there either
