"""What memory allows a decode step, so that a bench can print each figure as a fraction of it.

A decode step of B streams reads every weight once (the served type: a GGUF file's blocks, or
dense bfloat16/float32) and the KV cache of every stream's context; on a CPU it cannot take less
than those bytes over the memory's read bandwidth. ``read_bandwidth`` measures that bandwidth
(an int64 ``torch.sum`` over a buffer far larger than the caches, on the threads the servers get,
best of a few: an integer sum, because a float sum's cascade summation costs enough compute to
read below the bandwidth); ``Step`` holds a set-up's bytes; ``fractions`` sets a run's figures against them: 1.0 is
at the memory limit, 0.25 leaves 4x to win. The context of a stream is its mean prompt length
plus half its output (the mean over its decode steps). Prompt processing is compute-bound, so a
TTFT has no memory fraction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

TOKENS_PER_WORD = 1.3  # a guess for a dry run, before any prompt was tokenized


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 8, threads: Optional[int] = None) -> float:
    """Bytes per second an int64 ``torch.sum`` reads from an ``nbytes`` buffer, best of ``repeats``."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        buffer = torch.ones(nbytes // 8, dtype=torch.int64)  # written once: every page is resident
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return nbytes / best


@dataclass(frozen=True)
class Step:
    """What one decode step of a set-up reads: its weights, and KV bytes per token of context."""

    weights: int
    kv_per_token: int

    def seconds(self, bandwidth: float, streams: int, context: float) -> float:
        return (self.weights + streams * self.kv_per_token * context) / bandwidth


def context_of(summary, output_tokens: int) -> Optional[float]:
    """A stream's mean context over its decode steps, from a phase's Summary (its prompt tokens)."""
    if summary is None or not summary.completed:
        return None
    prompt = summary.input_throughput * summary.duration_s / summary.completed
    return prompt + output_tokens / 2


def fractions(step: Step, bandwidth: float, one, many, streams: int, output_tokens: int) -> dict:
    """{figure key: measured / allowed} for the decode figures of ``one`` and ``many`` (Summaries)."""
    out: dict = {}
    for prefix, summary, n in (("one", one, 1), ("many", many, streams)):
        context = context_of(summary, output_tokens)
        if context is None:
            continue
        allowed_s = step.seconds(bandwidth, n, context)
        out[f"{prefix}_tok_s"] = summary.output_throughput * allowed_s / n
        for pct in ("p50", "p99"):
            itl = summary.itl_ms.get(pct)
            if itl:
                out[f"{prefix}_itl_{pct}"] = allowed_s * 1e3 / itl
    return out


def allowed_line(step: Step, bandwidth: float, streams: int, context: float) -> str:
    """What memory allows at ``context`` tokens: one stream's ITL and ``streams`` streams' tokens/s."""
    one = step.seconds(bandwidth, 1, context)
    many = step.seconds(bandwidth, streams, context)
    return (f"memory allows ITL >= {one * 1e3:.1f} ms on one stream, <= {streams / many:.0f} tok/s on {streams} "
            f"(weights {step.weights / 1e6:.0f} MB + KV {step.kv_per_token / 1e3:.1f} kB/token x {context:.0f} "
            f"tokens per stream, at {bandwidth / 1e9:.1f} GB/s)")
