"""What sampling one token costs on SmolLM2's 49,152 logits: the sampler against the path it
replaced (a stable float64 sort of the whole vocabulary, in torch's threads), interleaved in one
run, per mode (greedy, temperature, top-k, top-p). Both draw the same tokens (checked here on
every call; ``tests/test_sampler.py`` checks it too). Prints the load average it ran under: on a
busy machine a second torch thread is what costs most. Usage::

    .venv/bin/python bench/sampler.py [--vocab 49152] [--tokens 30] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from splitserve.engine.io import SamplingParams
from splitserve.engine.sampler import _scaled, greedy_tokens, sample_token, uniform_for


def whole_sort(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The draw before: the whole vocabulary sorted as float64, in torch's threads."""
    if params.greedy:
        return greedy_tokens.__wrapped__(logits[None])[0]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--tokens", type=int, default=30, help="draws per mode and path, in turns")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.vocab, generator=g) * 3
    modes = {"greedy": SamplingParams(temperature=0.0), "temperature 1": SamplingParams(temperature=1.0),
             "top_k 50": SamplingParams(temperature=0.8, top_k=50), "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9)}
    paths = {"sampler": sample_token, "whole sort": whole_sort}
    load0 = os.getloadavg()[0]
    print(f"vocab {args.vocab}, {args.tokens} draws each, torch threads {torch.get_num_threads()}, "
          f"load average {load0:.1f} at the start")
    print(f"{'mode':>14} {'sampler ms':>11} {'whole sort ms':>14} {'ratio':>6}")
    for name, params in modes.items():
        spent = {p: [] for p in paths}
        for pos in range(args.tokens):
            drawn = set()
            for path, fn in paths.items():
                t0 = time.perf_counter()
                drawn.add(fn(logits, params, 7, pos))
                spent[path].append(time.perf_counter() - t0)
            assert len(drawn) == 1, (name, pos, drawn)
        med = {p: sorted(v)[len(v) // 2] * 1e3 for p, v in spent.items()}
        print(f"{name:>14} {med['sampler']:>11.2f} {med['whole sort']:>14.2f} {med['whole sort'] / med['sampler']:>5.1f}x")
    print(f"medians; load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
