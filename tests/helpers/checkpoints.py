"""``make_checkpoint``: a small random transformers checkpoint on disk, and the model it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 500
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def make_checkpoint(path: Path, family: str, overrides: dict, save: dict, seed: int = 0):
    """Save a random transformers model to ``path``; returns it (the reference), in float32 eval mode."""
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(seed)
    config = config_cls(**{**SMALL, **overrides})
    hf = model_cls(config).eval()
    with torch.no_grad():  # move every weight off its init value (norms off 1, biases off 0)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    shard = {"max_shard_size": save["max_shard_size"]} if "max_shard_size" in save else {}
    hf.save_pretrained(path, safe_serialization=True, **shard)
    if save.get("v4_rope_spelling"):
        cfg = json.loads((path / "config.json").read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
        (path / "config.json").write_text(json.dumps(cfg))
    return hf
