"""Rotary position embeddings (the "rotate half" layout of Hugging Face Llama/Qwen checkpoints).

cos/sin are computed once per forward from the inverse frequencies and the tokens' absolute
positions, in float32, exactly as the reference does, so no [max_context, head_dim] table is kept
(that is 128 MiB for a 128k-context model). Scaling types: ``default``, ``linear`` and ``llama3``
(Llama 3.1+); others fail at load time with a clear error.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, after the checkpoint's rope scaling."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    # device="cpu" so this is real even when the model is built on the meta device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the middle band interpolated
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """``cos_sin(positions)`` once per forward; the rotation itself is an op of ``layers/ops.py``
    (``rope_store``), applied to q and k of every layer."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        # a plain attribute, not a buffer: stays float32 whatever dtype the model is cast to
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)  # [head_dim // 2]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim // 2] float32 (the reference's angles)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim // 2]
        return freqs.cos(), freqs.sin()
