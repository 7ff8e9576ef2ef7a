"""Bootstrap info (``splitserve/disagg/bootstrap.py``): the model identity two workers compare
before exchanging KV pages. Same checkpoint anywhere: same identity; another tokenizer or other
weights under the same config.json (two quantizations of one model), or the same weights loaded in
other types (``--quantization``): another identity, so the pair refuses each other with
``incompatible_peer`` naming ``model``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from splitserve.disagg.bootstrap import first_mismatch, local_info, model_identity
from splitserve.engine.kv_pool import KVLayout

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
LAYOUT = KVLayout(num_pages=4, num_layers=2, page_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)


def checkpoint(path: Path, weights: dict, tokenizer: str = '{"model": "bpe-a"}') -> SimpleNamespace:
    """A checkpoint folder (config.json, tokenizer.json, model.safetensors) and a spec naming it."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    (path / "tokenizer.json").write_text(tokenizer)
    save_file(weights, str(path / "model.safetensors"))
    return SimpleNamespace(path=str(path), architecture="LlamaForCausalLM")


@pytest.fixture
def weights() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(512, 64, generator=g),
            "model.norm.weight": torch.randn(64, generator=g)}


def mismatch(a, b) -> str | None:
    return first_mismatch(local_info(a, LAYOUT, "nixl", "i-a"), local_info(b, LAYOUT, "nixl", "i-b"))


def test_a_copy_of_the_checkpoint_elsewhere_is_the_same_model(tmp_path, weights):
    a = checkpoint(tmp_path / "a", weights)
    shutil.copytree(a.path, tmp_path / "b")
    b = SimpleNamespace(path=str(tmp_path / "b"), architecture=a.architecture)
    assert model_identity(a) == model_identity(b) != f"{a.architecture}:unknown"
    assert mismatch(a, b) is None


def test_another_tokenizer_is_another_model(tmp_path, weights):
    a = checkpoint(tmp_path / "a", weights)
    b = checkpoint(tmp_path / "b", weights, tokenizer='{"model": "bpe-b"}')
    assert model_identity(a) != model_identity(b)
    assert mismatch(a, b).startswith("model (ours LlamaForCausalLM:")


def test_other_weights_under_the_same_config_are_another_model(tmp_path, weights):
    """What a second quantization of the same model looks like: every value a little different."""
    a = checkpoint(tmp_path / "a", weights)
    requantized = {k: (v * 64).round() / 64 for k, v in weights.items()}
    b = checkpoint(tmp_path / "b", requantized)
    assert model_identity(a) != model_identity(b)
    assert mismatch(a, b).startswith("model (")


def test_one_changed_tensor_changes_the_identity(tmp_path, weights):
    a = checkpoint(tmp_path / "a", weights)
    b = checkpoint(tmp_path / "b", {**weights, "model.norm.weight": weights["model.norm.weight"] + 1})
    assert model_identity(a) != model_identity(b)


def test_the_same_file_loaded_in_other_types_is_another_model(tmp_path, weights):
    """One GGUF file served with its quantized tensors kept (``--quantization auto``) and expanded
    (``none``) computes other logits: the pair refuses each other, naming both."""
    a = checkpoint(tmp_path / "a", weights)
    kept = SimpleNamespace(path=a.path, architecture=a.architecture, quantization="Q4_1:210,Q8_0:1")
    expanded = SimpleNamespace(path=a.path, architecture=a.architecture, quantization="none")
    assert model_identity(kept).endswith("/Q4_1:210,Q8_0:1") and model_identity(expanded).endswith("/none")
    assert model_identity(kept).split("/")[0] == model_identity(expanded).split("/")[0]
    assert mismatch(kept, expanded) == f"model (ours {model_identity(kept)}, peer's {model_identity(expanded)})"
    assert mismatch(kept, SimpleNamespace(**vars(kept))) is None
