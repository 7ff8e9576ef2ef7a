"""Runs one scheduled batch through the model: flattens the sequences' new tokens, builds the
attention metadata from their page tables, and returns the logits of the sequences that sample.

Shapes: ``T`` = total new tokens in the step, ``S`` = sequences that sample a token this step.
"""

from __future__ import annotations

import torch

from splitserve.engine.kv_pool import KVPool
from splitserve.engine.scheduler import ScheduledSeq
from splitserve.layers.attention import AttentionMetadata, SeqAttention


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVPool):
        self.model = model
        self.kv = kv
        self.page_size = kv.layout.page_size
        self.device = kv.buffer.device

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Forward the batch; returns float32 logits [S, vocab] for the sampling sequences, in batch order."""
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqAttention] = []
        last_rows: list[int] = []
        for item in batch:
            seq, start, n = item.seq, item.seq.num_computed, item.num_tokens
            kv_len = start + n
            seqs.append(SeqAttention(
                q_start=len(ids), q_len=n, kv_len=kv_len,
                page_table=torch.tensor(seq.pages[:-(-kv_len // self.page_size)], dtype=torch.long,
                                        device=self.device),
            ))
            ids += seq.token_ids[start:kv_len]
            positions += range(start, kv_len)
            if item.samples:
                last_rows.append(len(ids) - 1)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        page_of = torch.cat([torch.tensor(item.seq.pages, dtype=torch.long)[
            torch.arange(item.seq.num_computed, item.seq.num_computed + item.num_tokens) // self.page_size]
            for item in batch]).to(self.device)  # [T]
        meta = AttentionMetadata(slot_pages=page_of, slot_offsets=pos % self.page_size, seqs=seqs)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(input_ids, pos, meta, self.kv)  # [T, hidden]
        if not last_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        rows = torch.tensor(last_rows, device=self.device)
        return self.model.compute_logits(hidden[rows]).float().cpu()  # [S, vocab]
