"""``PagedSequences``: sequences sharing one KV pool, pages from a shuffled free list, so page
tables cross page boundaries and are not contiguous; ``run_step``: a model's forward over one step
of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.layers.attention import build_metadata
from splitserve.models.loader import ModelSpec

PAGE_SIZE = 4


class PagedSequences:
    """Sequences sharing one KV pool. Pages come from a shuffled free list (non-contiguous tables)."""

    def __init__(self, spec: ModelSpec, num_pages: int = 48, seed: int = 0):
        self.kv = KVPool(KVLayout(num_pages, spec.num_layers, PAGE_SIZE, spec.num_kv_heads, spec.head_dim,
                                  spec.dtype))
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens: list[list[int]] = []  # every token of each sequence so far
        self.pages: list[list[int]] = []
        self.cached: list[int] = []  # tokens whose KV is in the pool

    def add(self, prompt: list[int]) -> int:
        self.tokens.append(list(prompt))
        self.pages.append([])
        self.cached.append(0)
        return len(self.tokens) - 1

    def step(self, work: list[tuple[int, int]]):
        """``work``: (sequence, number of its next uncached tokens). Returns input_ids, positions, meta."""
        ids, positions, described = [], [], []
        for s, n in work:
            start, kv_len = self.cached[s], self.cached[s] + n
            assert kv_len <= len(self.tokens[s])
            while len(self.pages[s]) * PAGE_SIZE < kv_len:
                self.pages[s].append(self.free.pop())
            described.append((start, n, self.pages[s]))
            ids += self.tokens[s][start:kv_len]
            positions += range(start, kv_len)
            self.cached[s] = kv_len
        meta = build_metadata(described, PAGE_SIZE, dtype=self.kv.layout.dtype)
        return torch.tensor(ids), torch.tensor(positions), meta


@torch.inference_mode()
def run_step(model, seqs: PagedSequences, work) -> list[torch.Tensor]:
    """Forward one step; per work item, the log-probs [n, vocab] of its new tokens."""
    ids, positions, meta = seqs.step(work)
    logprobs = F.log_softmax(model.compute_logits(model(ids, positions, meta, seqs.kv)), dim=-1)  # [T, V]
    return [logprobs[m.q_start:m.q_start + m.q_len] for m in meta.seqs]
