"""Token sampling: greedy, temperature, top-k, top-p, with randomness drawn per (seed, position).

Each sampled token uses one uniform number from a generator seeded by ``mix(seed, position)``, and
picks the token whose cumulative probability first exceeds it. So a seeded request produces the
same tokens whatever it is batched with, after a preemption, and on whichever worker it runs
(prefill samples the first token, decode the rest).
"""

from __future__ import annotations

import torch

from splitserve.engine.io import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a well-spread 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def uniform_for(seed: int, position: int) -> float:
    g = torch.Generator().manual_seed(mix_seed(seed, position))
    return torch.rand((), generator=g, dtype=torch.float64).item()


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """One token from ``logits`` [vocab] (float32) for the token at absolute ``position``."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits.double() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.numel())
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    if params.top_p < 1.0:
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        keep = (cum - sorted_probs) < params.top_p
        sorted_probs = sorted_probs * keep
    cum = torch.cumsum(sorted_probs, dim=-1)
    u = uniform_for(seed, position) * cum[-1].item()
    idx = int(torch.searchsorted(cum, torch.tensor([u], dtype=cum.dtype), right=True).item())
    idx = min(idx, int((sorted_probs > 0).sum().item()) - 1)
    return int(order[idx].item())


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 positions: list[int]) -> list[int]:
    """Tokens for each row of ``logits`` [B, vocab]; greedy rows in one argmax."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [greedy[i] if p.greedy else sample_token(logits[i], p, seeds[i], positions[i])
            for i, p in enumerate(params)]
