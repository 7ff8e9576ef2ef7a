"""Model implementations, looked up by the ``architectures[0]`` of a checkpoint's config.json.

The registry maps an architecture name to ``(module, class)`` and imports lazily, so importing
this package costs nothing and a model file is only loaded when a checkpoint needs it. Every model
implements::

    forward(input_ids [T], positions [T], meta: AttentionMetadata, kv: KVLayers) -> hidden [T, hidden]
    compute_logits(hidden [N, hidden]) -> logits [N, vocab] float32
    load_weights(Iterable[(hf_name, tensor)]) -> None

``loader.load_model`` reads a checkpoint directory into one of these.
"""

from __future__ import annotations

import importlib

_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("splitserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("splitserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("splitserve.models.qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type:
    """The model class for a config.json ``architectures[0]``; ValueError listing the supported ones."""
    if architecture not in _REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, name = _REGISTRY[architecture]
    return getattr(importlib.import_module(module), name)
