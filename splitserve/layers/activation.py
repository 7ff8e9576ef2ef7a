"""Activations of the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """The SwiGLU gate on a fused gate|up projection: [T, 2*I] -> silu(gate) * up, [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up
