"""Runs one scheduled batch through the model: flattens the sequences' new tokens, builds the
attention metadata once for all layers (``layers/attention.py``), and returns the logits of the
sequences that sample. It gives the model the compiled per-layer ops and float32 matmuls when
they are available (``layers/ops.py``), else the model keeps the PyTorch reference ops, and the
``progress`` callback the model calls after each decoder layer: a long step reports that it moves,
so the engine loop's watchdog tells a slow step from a stuck one (``engine/async_engine.py``).

Decoding sequences (one new token) go first in the flat batch, in scheduling order, then the
prefill chunks: the decode rows are then rows 0..B-1, which the batched decode attention reads
without gathering them. Logits come back in the scheduler's order whatever the flat order.

Shapes: ``T`` = total new tokens in the step, ``S`` = sequences that sample a token this step.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from splitserve.engine.kv_pool import KVPool
from splitserve.engine.scheduler import ScheduledSeq
from splitserve.layers.attention import build_metadata
from splitserve.layers.linear import packing_available
from splitserve.layers.ops import best_ops
from splitserve.models.packed_file import share_weights

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVPool, progress: Callable[[], None] = lambda: None):
        self.model = model
        self.model.progress = progress  # after each layer of a forward pass
        self.kv = kv
        self.page_size = kv.layout.page_size
        self.device = kv.buffer.device
        self.dtype = kv.layout.dtype
        packed = model.pack_weights() if packing_available(self.dtype, self.device) else 0
        dense = model.set_ops(best_ops(self.device, self.dtype))  # compiled kernels where available
        log.info("model ops: %s; packed weights: %d; dense float32 weights through the kernels: %d",
                 self.model.ops.name, packed, dense)
        share_weights(model)  # one copy per host: the packed weights mapped from a file all workers map

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], every_row_of: Sequence[int] = ()) -> torch.Tensor:
        """Forward the batch; returns float32 logits [S, vocab] for the sampling sequences, in batch
        order. ``every_row_of``: batch indices (ascending) whose every new row's logits the engine
        needs too (a prompt's logprobs): they follow the S rows, ``num_tokens`` rows each."""
        order = [i for i, item in enumerate(batch) if item.num_tokens == 1]
        order += [i for i, item in enumerate(batch) if item.num_tokens != 1]
        ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # batch index -> its last row in the flat batch
        for i in order:
            seq, n = batch[i].seq, batch[i].num_tokens
            start = seq.num_computed
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            last_row[i] = len(ids) - 1
        meta = build_metadata([(batch[i].seq.num_computed, batch[i].num_tokens, batch[i].seq.pages) for i in order],
                              self.page_size, self.device, self.dtype)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(input_ids, pos, meta, self.kv)  # [T, hidden]
        rows = [last_row[i] for i, item in enumerate(batch) if item.samples]
        for i in every_row_of:
            rows += range(last_row[i] - batch[i].num_tokens + 1, last_row[i] + 1)
        if not rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        if rows != list(range(len(rows))):
            hidden = hidden[torch.tensor(rows, device=self.device)]
        else:
            hidden = hidden[:len(rows)]
        return self.model.compute_logits(hidden).float().cpu()  # [S, vocab]
