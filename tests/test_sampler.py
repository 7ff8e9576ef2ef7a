"""Sampling: greedy, top-k, top-p, randomness that depends only on (seed, position), and logits
that are not finite numbers (NaN, inf, overflow at a tiny temperature)."""

import pytest
import torch

from splitserve.engine.io import SamplingParams
from splitserve.engine.sampler import (NoFiniteLogits, _scaled, greedy_tokens, mix_seed, sample_batch, sample_token,
                                       token_logprobs, uniform_for)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    assert sample_batch(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0], [0, 0]) == [1, 0]


def test_same_seed_and_position_give_the_same_token_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    p = SamplingParams(temperature=1.0)
    alone = sample_token(logits[2], p, seed=7, position=33)
    batched = sample_batch(logits, [p] * 4, [1, 2, 7, 9], [5, 6, 33, 8])
    assert batched[2] == alone
    # other positions draw other numbers: over many positions the tokens vary
    assert len({sample_token(logits[2], p, 7, pos) for pos in range(50)}) > 5


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(1000)
    best = int(torch.argmax(logits))
    for pos in range(20):
        assert sample_token(logits, SamplingParams(temperature=1.0, top_k=1), 3, pos) == best
        assert sample_token(logits, SamplingParams(temperature=1.0, top_p=1e-6), 3, pos) == best


def test_top_k_restricts_to_the_k_best():
    torch.manual_seed(2)
    logits = torch.randn(500)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    drawn = {sample_token(logits, SamplingParams(temperature=2.0, top_k=5), 11, pos) for pos in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    counts = [0, 0, 0]
    for pos in range(3000):
        counts[sample_token(logits, SamplingParams(temperature=1.0), 5, pos)] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_mix_seed_spreads_neighbours():
    assert len({mix_seed(s, p) for s in range(20) for p in range(20)}) == 400


def test_a_tiny_temperature_is_near_greedy_never_garbage():
    """T = 1e-308 overflowed logits / T to inf, softmax to NaN, and the pick fell on the last token
    of the sort (token 2047 of the tiny model, every time). Any T > 0 is near-greedy as T shrinks."""
    torch.manual_seed(3)
    logits = torch.randn(2048) * 5
    best = int(torch.argmax(logits))
    for t in (1e-308, 5e-324, 1e-30, 1e-6):
        for extra in ({}, {"top_k": 50}, {"top_p": 0.9}):
            p = SamplingParams(temperature=t, **extra)
            assert {sample_token(logits, p, 9, pos) for pos in range(20)} == {best}, (t, extra)
    tied = torch.tensor([1.0, 4.0, 4.0, -2.0])  # a tie at the top: either best, nothing else
    assert {sample_token(tied, SamplingParams(temperature=1e-308), 1, pos) for pos in range(60)} == {1, 2}


def test_nan_logits_never_win_and_a_row_without_a_finite_one_raises():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, 0.5, 2.0, nan], [1.0, inf, nan, 3.0]])
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1e-308)):
        for pos in range(20):
            assert sample_batch(logits, [params] * 2, [4, 4], [pos, pos]) == [2, 1], params
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=5.0, top_k=3, top_p=0.99)):
        drawn = [sample_batch(logits, [params] * 2, [4, 4], [pos, pos]) for pos in range(60)]
        assert {a for a, _ in drawn} == {1, 2} and {b for _, b in drawn} == {1}, params  # a NaN never; +inf always
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        for row in (torch.full((5,), nan), torch.full((5,), -inf)):
            with pytest.raises(NoFiniteLogits):
                sample_batch(row[None], [params], [0], [0])
    assert greedy_tokens(torch.stack([torch.full((3,), nan), torch.tensor([0.0, 1.0, nan])])) == [None, 1]


def full_sort_draw(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The draw as the sampler's docstring defines it, over a stable descending sort of the whole
    vocabulary (what ``sample_token`` did before it sorted only the tokens that can be drawn)."""
    x = _scaled(logits, params.temperature)
    if params.top_k > 0:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    sorted_probs, order = torch.sort(torch.softmax(x, dim=-1), descending=True, stable=True)
    if params.top_p < 1.0:
        cum = torch.cumsum(sorted_probs, dim=-1)
        sorted_probs = sorted_probs * ((cum - sorted_probs) < params.top_p)
    cum = torch.cumsum(sorted_probs, dim=-1)
    u = uniform_for(seed, position) * cum[-1].item()
    idx = int(torch.searchsorted(cum, torch.tensor([u], dtype=cum.dtype), right=True).item())
    return int(order[min(idx, int((sorted_probs > 0).sum().item()) - 1)].item())


def test_seeded_draws_equal_a_sort_of_the_whole_vocabulary():
    """Every seeded token is the one the full sort gives: on SmolLM2's vocabulary size, with ties
    (logits rounded to a coarse grid, as bfloat16 logits are), masked tokens, top-k, top-p."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(49152, generator=g) * 3
    tied = torch.round(torch.randn(3000, generator=g) * 4) / 2  # ~40 distinct values
    masked = tied.clone()
    masked[::3] = float("-inf")
    cases = [SamplingParams(temperature=t, top_k=k, top_p=p)
             for t in (0.3, 1.0, 2.5) for k in (0, 1, 7, 50) for p in (1.0, 0.9, 0.3)]
    draws = same = 0
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the full sorts on a busy machine: one thread is seconds faster
    try:
        for logits in (wide, tied, masked):
            for params in cases:
                for pos in range(3):
                    draws += 1
                    same += sample_token(logits, params, 21, pos) == full_sort_draw(logits, params, 21, pos)
    finally:
        torch.set_num_threads(before)
    assert same == draws == 324


def test_sampling_leaves_torch_threads_as_they_were():
    """The sampler runs its ops on one thread and gives the count back, also when it raises."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = torch.randn(2, 100)
        sample_batch(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5)], [1, 1], [0, 0])
        assert torch.get_num_threads() == 2
        with pytest.raises(NoFiniteLogits):
            sample_token(torch.full((5,), float("-inf")), SamplingParams(temperature=1.0), 1, 0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_top_logprobs_equal_a_stable_sort_of_the_whole_row():
    """The top logprobs are a stable sort's head (ties: the lower id first), also where ties at the
    k-th value reach past it and where a row has fewer finite logits than asked."""
    g = torch.Generator().manual_seed(5)
    rows = torch.cat([torch.randn(3, 4000, generator=g) * 3,
                      torch.round(torch.randn(3, 4000, generator=g) * 2)])  # ~20 distinct values: ties
    rows[5, 7:] = float("-inf")  # 7 finite logits, 20 asked
    tokens, top = [0] * len(rows), [20, 1, 5, 20, 3, 20]
    got = token_logprobs(rows, tokens, top)
    lp = torch.log_softmax(rows.double(), dim=-1).float()
    for row, entry in enumerate(got):
        order = torch.sort(-lp[row], stable=True).indices[:top[row]]
        assert entry.top == tuple(zip(order.tolist(), lp[row, order].tolist())), row
