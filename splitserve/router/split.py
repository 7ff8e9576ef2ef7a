"""Whether a request is split (a prefill and a decode leg) or goes to a decode worker alone
(``docs/router.md`` has why and how to choose the threshold).

The rule (:func:`decide`): a request whose prompt's *uncached* part is estimated at
``--pd-threshold-tokens`` or more is split; a shorter one goes alone; ``0`` splits every request.
A request that must run on one worker goes alone whatever its length (:func:`one_worker`): one
that asks for its prompt's logprobs (``echo`` with ``logprobs``, ``/generate``'s
``logprob_start_len``) or for ``max_tokens`` 0 (prefill always samples a first token).

The router has no tokenizer. Its estimate of a prompt's length (:func:`estimate_tokens`): the
number of token ids when the request carries them; else the text's length in characters (chat
messages as the routing key writes them) divided by ``--pd-chars-per-token``. The part the chosen
decode worker is known to hold in its prefix cache is subtracted where the router knows it
(``cache_aware``'s index: :func:`known_cached_tokens`); other policies subtract nothing.

Decisions are counted (``splitserve_router_pd_decisions_total{decision}``): ``split``, ``alone``,
and ``fallback`` (to be split, but sent to decode alone because its prefill leg failed before
prefill accepted it and no retry was left, or no prefill worker was up).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from splitserve.engine.io import SamplingParams
from splitserve.router.policy import CacheAware, Policy
from splitserve.router.workers import Worker

DECISIONS = ("split", "alone", "fallback")


def estimate_tokens(key: str, prompt_ids: Optional[Sequence[int]], chars_per_token: float) -> int:
    """The prompt's length in tokens: exact for token ids, else the routing key's characters
    divided by ``chars_per_token``."""
    if prompt_ids is not None:
        return len(prompt_ids)
    return math.ceil(len(key) / chars_per_token)


def known_cached_tokens(policy: Policy, decodes: Sequence[Worker], key: str, tokens: int) -> int:
    """What the router knows the best of ``decodes`` holds of this prompt in its prefix cache, in
    tokens (``cache_aware`` only: the share of the key its index has seen sent there, whole
    blocks); 0 for every other policy. Read only: the policy learns nothing from it."""
    if not isinstance(policy, CacheAware) or not key or not decodes:
        return 0
    blocks = policy.blocks(key)
    best = max(policy.match(w, blocks) for w in decodes)
    return (tokens * best * policy.knobs.block_chars) // len(key)


def one_worker(sampling: SamplingParams) -> bool:
    """Whether a request runs on one worker only, never split: its prompt's logprobs, or
    ``max_tokens`` 0 (what a split worker refuses: ``engine.LLMEngine._one_worker_only``)."""
    return sampling.prompt_logprobs is not None or sampling.max_tokens == 0


def decide(threshold: int, tokens: int, cached: int, one_worker: bool = False) -> str:
    """``split`` when the uncached part (``tokens - cached``) is at least ``threshold`` (0: every
    request), else ``alone``; always ``alone`` for a request that runs on ``one_worker``."""
    if one_worker:
        return "alone"
    return "split" if threshold == 0 or tokens - cached >= threshold else "alone"
