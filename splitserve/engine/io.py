"""What goes into the engine and what comes out: typed, immutable, shared by the server and router.

A request is validated and tokenized before it gets here (``splitserve/validation/``); the engine
only sees token ids and :class:`SamplingParams`. It answers with a stream of
:class:`RequestOutput` deltas, the last one with ``finished=True``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Optional

from splitserve.errors import FLUSH_WAIT_S, EngineError, InvalidRequest, NotReady, Overloaded  # noqa: F401
from splitserve.outcomes import Ending, Reason

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request names none (documented in the README and ``--help``)."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives per token a request may ask logprobs for (OpenAI's cap on ``top_logprobs``)."""
MAX_LOGIT_BIAS = 300
"""The most tokens one request's ``logit_bias`` may name (OpenAI's cap)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: Optional[int] = None  # None: the engine draws one; randomness is drawn per (seed, position)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    """None: no logprobs; k in [0, MAX_TOP_LOGPROBS]: each generated token's logprob and the k most
    likely tokens' (``TokenLogprob``), from the raw logits (before temperature and any mask)."""
    prompt_logprobs: Optional[int] = None
    """None: none; k: each prompt token's logprob (but the first's) and k alternatives. Such a
    request computes its whole prompt (no prefix cache) on one worker."""
    n: int = 1
    """Choices from the one prompt (``engine.py``: the others fork from the first when its prompt
    has run); choice i > 0 draws with ``choice_seed(seed, i)``."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the answer holds so far (OpenAI's, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the answer holds it so far (OpenAI's, -2..2)."""
    repetition_penalty: float = 1.0
    """SGLang's and vLLM's: a token of the prompt or the answer has its logit divided by it when
    positive, multiplied when negative (1: none)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias): added to that token's logit (OpenAI's, -100..100; at most
    :data:`MAX_LOGIT_BIAS` tokens)."""

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes the logits it samples from (``engine/sampler.py``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model's raw distribution (``log_softmax`` of the
    logits before temperature, top-k/top-p and any mask: OpenAI's convention), and the ``top``
    most likely tokens as (token id, logprob), most likely first. ``-inf`` stays ``-inf`` here
    (the JSON answer writes it as -9999.0, as vLLM does)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    _HEAD = struct.Struct("<f")
    _ENTRY = struct.Struct("<if")

    def to_bytes(self) -> bytes:
        """The wire form (prefill to decode, with the first token): float32, exactly as computed."""
        return self._HEAD.pack(self.logprob) + b"".join(self._ENTRY.pack(t, lp) for t, lp in self.top)

    @classmethod
    def from_bytes(cls, data: bytes, top: int, vocab_size: int) -> "TokenLogprob":
        """Parse :meth:`to_bytes` from a peer, expecting ``top`` alternatives (or fewer when the
        vocabulary is smaller); raises InvalidRequest for anything else: a wrong size, a token
        outside the vocabulary, a logprob that is NaN or positive."""
        want = min(top, vocab_size)
        if len(data) != cls._HEAD.size + want * cls._ENTRY.size:
            raise InvalidRequest(f"first token's logprobs of {len(data)} bytes; expected {want} alternatives")
        (lp,) = cls._HEAD.unpack_from(data)
        entries = [cls._ENTRY.unpack_from(data, cls._HEAD.size + i * cls._ENTRY.size) for i in range(want)]
        for value in [lp] + [v for _, v in entries]:
            if math.isnan(value) or value > 0.0:
                raise InvalidRequest(f"first token's logprob {value} is not a log-probability")
        for t, _ in entries:
            if not 0 <= t < vocab_size:
                raise InvalidRequest(f"first token's alternative {t} is outside the vocabulary")
        return cls(lp, tuple(entries))


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request meets its peer (the SGLang PD fields the router adds)."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class GenerateRequest:
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    bootstrap: Optional[Bootstrap] = None  # set on prefill and decode workers, None when colocated
    cache_salt: str = ""  # prefix-cache pages are shared only among requests with the same salt
    stop_matcher: Optional[object] = field(default=None, compare=False, repr=False)
    """The automaton of ``sampling.stop`` (``engine/detokenizer.StopMatcher``), built off the engine
    loop at validation; None: the engine builds it."""
    grammar: Optional[object] = field(default=None, compare=False, repr=False)
    """The request's own ``engine/grammar_compiler.Grammar`` of a structured output
    (``response_format``), compiled off the engine loop; None: unconstrained."""
    continuation: Optional[object] = None
    """``engine/continuation.Continuation``: the rest of an answer whose worker was lost; its
    choices start from the ids given, replayed without a delta (``LLMEngine._continued``)."""
    deadline_s: Optional[float] = None
    """Seconds its sender gives it from arrival (the router's ``X-Splitserve-Deadline-S``): it may
    only end the request sooner than this worker's own bounds, never later."""


@dataclass(frozen=True)
class RequestOutput:
    """One delta of a request's answer. ``text`` never ends in the middle of a UTF-8 character
    nor in what may still become a stop string, so concatenated deltas equal the final text.

    A failed or aborted request's last delta has ``reason`` (``splitserve/outcomes.py``) and
    ``error``, the message a client reads; its HTTP status is the reason's."""

    rid: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" on success
    error: Optional[str] = None  # set when the request failed or was aborted; finish_reason is None
    reason: Optional[Reason] = None  # why it failed or was aborted (set with ``error``)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token of ``token_ids`` when the request asked for logprobs, else empty."""
    prompt_logprobs: tuple[Optional[TokenLogprob], ...] = ()
    """On the first delta of a request that asked: one per prompt token, None for the first."""
    index: int = 0
    """The choice this delta belongs to (``SamplingParams.n``). With n > 1 a choice that ends has
    its ``finish_reason`` on its last delta, and ``finished`` comes with the last choice's end."""

    @classmethod
    def ended(cls, rid: str, ending: Ending, **counts: int) -> "RequestOutput":
        """The last delta of a request that failed or was aborted."""
        return cls(rid=rid, finished=True, error=ending.message, reason=ending.reason, **counts)

    @property
    def status(self) -> int:
        """The HTTP status of a failed request (500 when no reason was given: a bug)."""
        return self.reason.http_status if self.reason is not None else 500
