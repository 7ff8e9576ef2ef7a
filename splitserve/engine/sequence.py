"""One request inside the engine: its tokens, its pages, and how far its KV has been computed.

States, in order: ``WAITING`` (not admitted, or preempted: holds no pages) → ``RUNNING`` (in the
batch; holds pages for ``num_computed`` tokens) → ``FINISHED``; or, for a disaggregated request,
``HELD`` instead of ``FINISHED``: out of the batch, its pages kept for its room, which frees them
(``disagg/``). A preempted sequence goes back to
``WAITING`` with its generated tokens kept; it recomputes their KV when admitted again, and since
sampling randomness is drawn per (seed, position) it continues exactly as it would have.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from splitserve.engine.io import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    HELD = "held"


@dataclass(eq=False)
class Sequence:
    rid: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pool
    finish_reason: Optional[str] = None
    detok: object = None  # IncrementalDetokenizer, set by the engine
    room: Optional[int] = None  # disaggregated: the bootstrap room; its pages belong to the room
    prefill_only: bool = False  # prefill worker: pages for the whole prompt at admission, no decode
    cache_salt: str = ""  # the prefix cache shares pages only among requests with the same salt
    salt_key: bytes = b""  # the salt's hash, where its chain of page keys starts (page_allocator.salt_key)
    page_keys: list = field(default_factory=list)  # prefix-cache keys of its first full pages (of its tokens)
    indexed: int = 0  # how many of ``pages`` have been offered to the prefix cache
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its last admission
    first_logprob: Optional[object] = None  # prefill-only: the first token's TokenLogprob, for its room
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob of prompt tokens [0, len) (None first)
    grammar: Optional[object] = None  # engine/grammar.GrammarState: masks each token it samples
    choice: int = 0  # which of the request's n choices (engine.py: choices > 0 fork from choice 0)
    request_rid: Optional[str] = None  # a choice > 0: its request's id (its own ``rid`` is the engine's key)
    order: int = -1  # its request's place in the scheduler's queue (a ticket; -1: not queued yet)
    promised: bool = False  # the scheduler promised its request's need (scheduler.py: admission)
    passed: int = 0  # later requests promised before it while its need did not fit
    continued: bool = False  # a continuation's choice: shares no prompt pages by promise, forks nothing

    @property
    def out_rid(self) -> str:
        """The request id its deltas carry."""
        return self.request_rid if self.request_rid is not None else self.rid

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asks for its prompt's logprobs and some are still to compute: it computes every
        prompt token (no prefix cache) until they are all in."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def decoding(self) -> bool:
        """Its next step computes one sampled token (a prompt's one-token last chunk does not
        count): the sequences ``step_pace.py`` times and budgets prompt chunks beside."""
        return self.num_uncomputed == 1 and self.num_output_tokens > 0
