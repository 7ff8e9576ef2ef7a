"""``bench/profile_step.py`` on the tiny model: its JSON has every part of every kind of step,
each a non-negative number of seconds, and the parts add up to the step (the rest being their
residual, itself the sum of its detail). Counts and sums only, no timing bounds."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, tiny_model


def test_profile_names_every_part_and_the_parts_add_up_to_the_step(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    import profile_step

    out = tmp_path / "profile.json"
    profile_step.main(["--model", str(tiny_model()), "--repeat", "1", "--warmup", "1", "--context", "20",
                       "--batch", "3", "--chunk", "24", "--result-json", str(out)])
    result = json.loads(out.read_text())
    assert list(result["kinds"]) == ["decode x1", "decode x3", "prompt 24"]
    assert {"cpu", "load_average"} <= result["machine"].keys()
    for name, kind in result["kinds"].items():
        assert list(kind["parts"]) == list(profile_step.PARTS), name
        assert list(kind["rest_detail"]) == [*profile_step.REST, "rest_other"], name
        seconds = [*kind["parts"].values(), *kind["rest_detail"].values(), kind["step_s"], kind["bare_step_s"]]
        assert all(s >= -1e-9 for s in seconds), (name, kind)  # one step: no residual of medians
        assert sum(kind["parts"].values()) == pytest.approx(kind["step_s"], abs=1e-9), name
        assert sum(kind["rest_detail"].values()) == pytest.approx(kind["parts"]["rest"], abs=1e-9), name
        assert kind["step_s"] > 0 and kind["parts"]["qkv"] > 0 and kind["parts"]["lm_head"] > 0, name
    printed = capsys.readouterr().out
    assert "load average" in printed and "prompt 24" in printed and "attention" in printed
