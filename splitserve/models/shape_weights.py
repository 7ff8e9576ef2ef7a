"""The random weights of a shape (``shapes.py``), drawn in blocks of rows so that a writer holds one
block at a time, never the model.

Every block is drawn from its own generator, seeded by (seed, tensor name, block index): the GGUF
writer and the Hugging Face writer, run one after the other, get bit-identical bfloat16 values
without holding them. The values:

- a matrix ~ N(0, 1/fan_in) (a std of 0.011-0.033 at the real shapes' widths, near the 0.02 of
  their initialisation), so that a projection of a unit-RMS input has unit-RMS outputs at any
  width: each layer adds O(1) to the residual stream, activations stay finite across 28 layers,
  attention scores have a standard deviation near 1 (neither uniform nor one-hot);
- the embedding and the q/k/v biases ~ N(0, 0.02^2), norm weights 1: the current token's own
  embedding is a small part of the residual stream, so the tied head does not make every token its
  own successor, and the logits have a standard deviation of 0.02 * sqrt(hidden) (0.6 at 896, 1.1
  at 3072);
- the embedding rows of ``quiet`` token ids (control tokens, the padding past the tokenizer) are
  ten times smaller: their logits stay near 0 while the real tokens' maximum is about four standard
  deviations up, so greedy decoding never picks them (no early end of stream, no ``[PAD..]`` text),
  while the LM head still computes every row of the real vocabulary.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable, Iterator

from splitserve.models.shapes import Tensor

if TYPE_CHECKING:
    import torch

STD = 0.02  # the embedding's and the biases'
QUIET = 0.1  # the quiet rows' scale
BLOCK_ROWS = 8192


def _generator(seed: int, name: str, block: int):
    import torch

    digest = hashlib.sha256(f"{seed}\0{name}\0{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def blocks(tensor: Tensor, seed: int, quiet: Iterable[int] = ()) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, bfloat16 rows) of ``tensor``, BLOCK_ROWS rows at a time, in order."""
    import torch

    if tensor.kind == "norm":
        yield 0, torch.ones(tensor.shape, dtype=torch.bfloat16)
        return
    quiet = sorted(set(quiet)) if tensor.kind == "embed" else []
    for block, start in enumerate(range(0, tensor.rows, BLOCK_ROWS)):
        stop = min(start + BLOCK_ROWS, tensor.rows)
        values = torch.randn((stop - start, *tensor.shape[1:]), generator=_generator(seed, tensor.name, block))
        values *= tensor.shape[1] ** -0.5 if tensor.kind == "matrix" else STD
        rows = [i - start for i in quiet if start <= i < stop]
        if rows:
            values[rows] *= QUIET
        yield start, values.to(torch.bfloat16)


def whole(tensor: Tensor, seed: int, quiet: Iterable[int] = ()) -> torch.Tensor:
    """All of ``tensor`` at once (for the small ones a writer permutes whole)."""
    import torch

    return torch.cat([values for _, values in blocks(tensor, seed, quiet)])
