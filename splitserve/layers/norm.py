"""RMSNorm: ``F.rms_norm``, one fused op that computes in float32 like the Hugging Face reference
(the same bits in float32; in bfloat16 one rounding fewer, as the weight is applied before the
cast back)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim. Used on hidden states [T, hidden] and, in Qwen3,
    per head on q/k [T, heads, head_dim]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
