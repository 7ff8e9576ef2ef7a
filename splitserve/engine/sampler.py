"""Token sampling: greedy, temperature, top-k, top-p, with randomness drawn per (seed, position).

Each sampled token uses one uniform number from a generator seeded by ``mix(seed, position)``, and
picks the token whose cumulative probability first exceeds it. So a seeded request produces the
same tokens whatever it is batched with, after a preemption, and on whichever worker it runs.

Logits that are not finite numbers: a NaN never wins (it counts as ``-inf``), a ``+inf`` wins over
every finite logit, and a row with no logit above ``-inf`` raises :class:`NoFiniteLogits` (the
engine fails that request alone). Temperature scales ``logits - max`` (no overflow to a NaN).
Logprobs (:func:`token_logprobs`): the log-softmax of the raw logits, before temperature, top-k,
top-p and any mask (OpenAI's convention), in float64 rounded to float32 on every worker alike.

Penalties and biases (:func:`adjust_logits`) change the logits a token is sampled from, before
temperature, top-k, top-p and any grammar mask, in this order: ``repetition_penalty`` (SGLang's
and vLLM's: a positive logit of a token of the prompt or the answer so far divided by it, a
negative one multiplied), then ``frequency_penalty`` per occurrence in the answer and
``presence_penalty`` once (OpenAI's: the answer's tokens only), subtracted, then ``logit_bias``
added (rows that ask for none untouched). The answer so far is the sequence's own tokens, so
prefill, decode, a preemption and a recompute adjust alike.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, TypeVar

import torch

from splitserve.engine.io import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1
F = TypeVar("F", bound=Callable)


def _one_thread(fn: F) -> F:
    """``fn`` run with torch's ops on the calling thread alone. The sampler's ops are over one
    vocabulary (49,152 logits on SmolLM2: large enough for ATen to split them in two), where waking
    a second thread saves microseconds on an idle machine and costs up to hundreds of milliseconds a
    token on a busy one, each op waiting at its barrier for a core (bench/sampler.py). None of
    them changes its bits with the thread count: no reduction here is split across threads."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        before = torch.get_num_threads()
        if before == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return run  # type: ignore[return-value]


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a well-spread 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request with ``n`` > 1 (choice 0 keeps ``seed``, so
    n = 1 draws as before): every choice draws its own numbers, the same whatever is batched."""
    return seed if choice == 0 else mix_seed(seed ^ 0x5DEECE66D, choice)


def uniform_for(seed: int, position: int) -> float:
    g = torch.Generator().manual_seed(mix_seed(seed, position))
    return torch.rand((), generator=g, dtype=torch.float64).item()


class NoFiniteLogits(ValueError):
    """The model gave no logit above ``-inf`` (all NaN, say) for a token: nothing can be sampled."""


def _finite_first(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with NaN as ``-inf``; the same tensor when it holds none (no copy)."""
    nan = torch.isnan(logits)
    return logits.masked_fill(nan, float("-inf")) if bool(nan.any()) else logits


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(logits - max) / temperature`` in float64: 0 at the best, never positive, never NaN."""
    x = _finite_first(logits.double())
    top = float(x.max())
    if top == float("inf"):  # the +inf logits are the candidates, alike
        return torch.where(x == top, 0.0, float("-inf")).to(x.dtype)
    if top == float("-inf"):
        raise NoFiniteLogits("the model gave no finite logit for this token")
    return (x - top) / temperature


@_one_thread
def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """For each row of ``logits`` [B, vocab]: the logprob of ``tokens[row]`` and the ``top[row]``
    most likely tokens (ties by the lower id first) under the raw distribution."""
    x = _finite_first(logits.double())
    best = x.max(dim=-1, keepdim=True).values
    inf = best == float("inf")
    if bool(inf.any()):  # rows with +inf logits: those tokens share the mass, alike
        x = torch.where(inf, torch.where(x == float("inf"), 0.0, float("-inf")), x)
    lp = torch.log_softmax(x, dim=-1).float()
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    k = min(max(top, default=0), lp.shape[-1])
    if k:
        ids, vals = _top_logprobs(lp, k)
    out = []
    for row, c in enumerate(chosen):
        n = min(top[row], k)
        out.append(TokenLogprob(c, tuple(zip(ids[row][:n], vals[row][:n])) if n else ()))
    return out


def _top_logprobs(lp: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's ``k`` best of ``lp`` [B, vocab], as a stable sort of ``-lp`` orders them (equal
    logprobs: the lower id first, the same on every worker): ``topk``'s k, put in that order, which
    is the whole sort's head unless ties at the k-th value reach past it (then that row is sorted
    whole). A whole sort of 49,152 a row cost ~4 ms; prompt logprobs ask it of every prompt row."""
    vals, ids = torch.topk(lp, k, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    vals = vals.gather(-1, by_id)
    order = torch.sort(-vals, dim=-1, stable=True).indices
    ids, vals = ids.gather(-1, order), vals.gather(-1, order)
    kth = vals[:, -1:]
    cut = ((lp == kth).sum(-1) != (vals == kth).sum(-1)).nonzero()[:, 0].tolist()
    if cut:  # tokens equal to the k-th that topk left out, some maybe of lower ids than those it kept
        whole = torch.sort(-lp[cut], dim=-1, stable=True).indices[:, :k]
        ids[cut], vals[cut] = whole, lp[cut].gather(-1, whole)
    return ids.tolist(), vals.tolist()


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], tokens: list[list[int]],
                  prompt_lens: list[int]) -> torch.Tensor:
    """``logits`` [B, vocab] with each row's penalties and bias applied (module docstring);
    ``tokens[row]`` is that row's sequence so far, whose first ``prompt_lens[row]`` are the
    prompt. The same tensor when no row asks for any (no copy), else a new one."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    sub = logits[rows].float()  # a copy: the raw logits stay for logprobs
    ps = [params[i] for i in rows]
    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = torch.zeros(sub.shape, dtype=torch.bool)
        ids = [(r, t) for r, i in enumerate(rows) if params[i].repetition_penalty != 1.0 for t in tokens[i]]
        if ids:
            at = torch.tensor(ids, dtype=torch.long)
            seen[at[:, 0], at[:, 1].clamp(0, vocab - 1)] = True
            rep = torch.tensor([p.repetition_penalty for p in ps], dtype=sub.dtype)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.presence_penalty or p.frequency_penalty for p in ps):
        outs = [(r, t) for r, i in enumerate(rows) if params[i].presence_penalty or params[i].frequency_penalty
                for t in tokens[i][prompt_lens[i]:]]
        if outs:
            at = torch.tensor(outs, dtype=torch.long)
            counts = torch.zeros(sub.shape, dtype=sub.dtype)
            counts.index_put_((at[:, 0], at[:, 1].clamp(0, vocab - 1)), torch.ones(len(outs), dtype=sub.dtype),
                              accumulate=True)
            freq = torch.tensor([p.frequency_penalty for p in ps], dtype=sub.dtype)[:, None]
            pres = torch.tensor([p.presence_penalty for p in ps], dtype=sub.dtype)[:, None]
            sub = sub - counts * freq - (counts > 0).to(sub.dtype) * pres
    bias = [(r, t, b) for r, i in enumerate(rows) for t, b in params[i].logit_bias if t < vocab]
    if bias:
        at = torch.tensor([(r, t) for r, t, _ in bias], dtype=torch.long)
        sub = sub.index_put((at[:, 0], at[:, 1]), torch.tensor([b for _, _, b in bias], dtype=sub.dtype),
                            accumulate=True)
    out = logits.clone() if logits.dtype == sub.dtype else logits.float()
    out[rows] = sub
    return out


@_one_thread
def greedy_tokens(logits: torch.Tensor) -> list[Optional[int]]:
    """The argmax of each row of ``logits`` [B, vocab], NaN never winning; None for a row with no
    logit above ``-inf``."""
    x = _finite_first(logits)
    best = torch.argmax(x, dim=-1)
    top = x.gather(-1, best[:, None])[:, 0]
    return [int(t) if ok else None for t, ok in zip(best.tolist(), (top > float("-inf")).tolist())]


def _sorted_candidates(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of nonzero probability and their probabilities, in the order of a stable
    descending sort of ``probs`` [vocab] float64 (ties: the lower id first): the same values and
    order as that sort's head, whose tail of zeros adds nothing to the draw. Sorted as int64 bit
    patterns (a non-negative double's order is its bits'), which torch sorts by radix, about 4x
    faster than the float sort on 49,152 logits; a top-k leaves only k to sort."""
    ids = torch.nonzero(probs > 0)[:, 0]
    values = probs[ids]
    by = torch.sort(-values.view(torch.int64), stable=True).indices
    return values[by], ids[by]


@_one_thread
def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """One token from ``logits`` [vocab] (float32) for the token at absolute ``position``."""
    if params.greedy:
        token = greedy_tokens(logits[None])[0]
        if token is None:
            raise NoFiniteLogits("the model gave no finite logit for this token")
        return token
    logits = _scaled(logits, params.temperature)
    if params.top_k > 0:
        k = min(params.top_k, logits.numel())
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = _sorted_candidates(probs)
    if params.top_p < 1.0:
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        keep = (cum - sorted_probs) < params.top_p
        sorted_probs = sorted_probs * keep
    cum = torch.cumsum(sorted_probs, dim=-1)
    u = uniform_for(seed, position) * cum[-1].item()
    idx = int(torch.searchsorted(cum, torch.tensor([u], dtype=cum.dtype), right=True).item())
    idx = min(idx, int((sorted_probs > 0).sum().item()) - 1)  # the best has probability >= 1/vocab: idx >= 0
    return int(order[idx].item())


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 positions: list[int]) -> list[int]:
    """Tokens for each row of ``logits`` [B, vocab]; greedy rows in one argmax. Raises
    NoFiniteLogits for a row with nothing to sample (the engine samples row by row instead, to
    fail only that row's request: :meth:`LLMEngine._advance`)."""
    greedy = greedy_tokens(logits) if any(p.greedy for p in params) else [None] * len(params)
    tokens = []
    for i, p in enumerate(params):
        if p.greedy and greedy[i] is None:
            raise NoFiniteLogits("the model gave no finite logit for this token")
        tokens.append(greedy[i] if p.greedy else sample_token(logits[i], p, seeds[i], positions[i]))
    return tokens
