"""Driving the scheduler without a model: a prompt-only sequence, and what the engine does to a
batch after its forward pass."""

from splitserve.engine.io import SamplingParams
from splitserve.engine.sequence import Sequence


def seq(rid, n, max_tokens=4):
    """A sequence of ``n`` prompt tokens (ids 0..n-1) asking for ``max_tokens``."""
    return Sequence(rid=rid, token_ids=list(range(n)), num_prompt_tokens=n,
                    sampling=SamplingParams(max_tokens=max_tokens), seed=0)


def advance(batch):
    """What the engine does after a forward: mark tokens computed, append a token where sampled."""
    for item in batch:
        sampled = item.samples
        item.seq.num_computed += item.num_tokens
        if sampled:
            item.seq.token_ids.append(0)
