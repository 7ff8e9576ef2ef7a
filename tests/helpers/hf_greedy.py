"""``hf_greedy``: transformers' own greedy generation, the reference the engine's tokens are checked against."""

from __future__ import annotations

import torch

_models: dict = {}  # model dir -> the transformers model, loaded once per test process


def hf_greedy(model_dir: str, ids: list[int], n: int) -> list[int]:
    """The ``n`` tokens transformers generates greedily after ``ids`` (float32)."""
    from transformers import AutoModelForCausalLM

    model = _models.get(model_dir)
    if model is None:
        model = _models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()
