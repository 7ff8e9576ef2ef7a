"""Prompts of random token ids, the same for the same seed."""

from __future__ import annotations

import random

VOCAB_LO, VOCAB_HI = 10, 2047  # clear of the tiny model's special tokens, inside its vocabulary
GREEDY = {"temperature": 0}  # sampling parameters of a greedy request
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 64, 100, 257]  # across page and chunk boundaries


def prompt(n: int, seed: int, high: int = VOCAB_HI) -> list[int]:
    """``n`` ids drawn from ``VOCAB_LO..high`` by ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [rng.randint(VOCAB_LO, high) for _ in range(n)]


def new_room() -> int:
    """A random bootstrap room number."""
    return random.getrandbits(63)


def prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """One prompt per length, ids in ``10..vocab-1`` drawn by torch's generator from ``seed``."""
    import torch  # here, not at the top: the process tests that use prompt() run without torch

    g = torch.Generator().manual_seed(seed)
    # stay clear of the special tokens, which the tiny tokenizer puts at the start of the vocab
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
