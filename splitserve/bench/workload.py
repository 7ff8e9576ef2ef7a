"""What the benchmark sends: random prompts, or multi-turn (agentic) sessions.

- **random**: ``n`` independent requests; prompt lengths ``input_len`` and answer lengths
  ``output_len``, each drawn uniformly within ``± range_ratio`` of it (as vLLM's random dataset).
  A prompt is token ids drawn from ``[10, 2000)`` (``prompt_format="ids"``: exact lengths, for
  servers that take a list of ids as ``prompt``, as vLLM, SGLang and splitserve do), or that many
  random common English words (``"text"``: any OpenAI-compatible server; about one token each).
  A new draw per request, so no answer can come from a prefix cache.
- **agentic**: sessions of ``turns`` chat turns. Turn 1 sends a system prompt and a user message of
  ``input_len`` words; each later turn sends the whole conversation so far (every earlier reply
  included) and a new user message of ``turn_len`` words, after ``think_s`` of thinking once the
  previous answer came: the way a coding agent's context grows.

Each request is cancelled (the client hangs up) with probability ``cancel_fraction``, after a
number of token events drawn from ``[0, output_len)`` (0: as soon as the answer's headers came);
a cancelled turn ends its session.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Union

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact house system program question night water money story "
         "month lot right study book job word business issue side kind head service friend father power hour game "
         "line end member law car city community name president team minute idea kid body information back parent "
         "face others level office door health art war history party result change morning reason research girl "
         "guy moment air teacher force education").split()
TOKEN_IDS = (10, 2000)


@dataclass(frozen=True)
class Spec:
    """One request to send."""

    max_tokens: int
    prompt: Union[list[int], str, None] = None  # completions
    messages: Optional[list[dict]] = None  # chat
    cancel_after: Optional[int] = None
    """Token events to read before hanging up; None: read the whole answer."""
    session: int = -1
    turn: int = 0

    @property
    def endpoint(self) -> str:
        return "chat" if self.messages is not None else "completions"


@dataclass(frozen=True)
class Workload:
    kind: str = "random"  # "random" | "agentic"
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    prompt_format: str = "ids"  # "ids" | "text"
    endpoint: str = "completions"  # random: "completions" | "chat"
    turns: int = 4
    turn_len: int = 32
    think_s: float = 0.5
    cancel_fraction: float = 0.0
    seed: int = 0

    def check(self) -> "Workload":
        if self.kind not in ("random", "agentic"):
            raise ValueError(f"--workload is random or agentic, not {self.kind!r}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError(f"--prompt-format is ids or text, not {self.prompt_format!r}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"--endpoint is completions or chat, not {self.endpoint!r}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--range-ratio must be in [0, 1)")
        if not 0 <= self.cancel_fraction <= 1:
            raise ValueError("--cancel-fraction must be in [0, 1]")
        if self.input_len < 1 or self.output_len < 1 or self.turns < 1:
            raise ValueError("--input-len, --output-len and --turns must be at least 1")
        return self


class Maker:
    """Draws the workload's requests from its own random generator (one seed, one workload)."""

    def __init__(self, w: Workload, seed_offset: int = 0):
        self.w = w
        self.rng = random.Random(w.seed + seed_offset)

    def _length(self, n: int) -> int:
        r = self.w.range_ratio
        return max(1, round(n * self.rng.uniform(1 - r, 1 + r))) if r else n

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _cancel(self, max_tokens: int) -> Optional[int]:
        if self.w.cancel_fraction and self.rng.random() < self.w.cancel_fraction:
            return self.rng.randrange(max_tokens)
        return None

    def random_request(self) -> Spec:
        n, out = self._length(self.w.input_len), self._length(self.w.output_len)
        if self.w.prompt_format == "ids":
            prompt: Union[list[int], str] = [self.rng.randrange(*TOKEN_IDS) for _ in range(n)]
        else:
            prompt = self._words(n)
        if self.w.endpoint == "chat":
            text = prompt if isinstance(prompt, str) else self._words(n)
            return Spec(out, messages=[{"role": "user", "content": text}], cancel_after=self._cancel(out))
        return Spec(out, prompt=prompt, cancel_after=self._cancel(out))

    def first_turn(self, session: int) -> Spec:
        out = self._length(self.w.output_len)
        messages = [{"role": "system", "content": "You are a coding agent. Answer briefly."},
                    {"role": "user", "content": self._words(self._length(self.w.input_len))}]
        return Spec(out, messages=messages, cancel_after=self._cancel(out), session=session, turn=0)

    def next_turn(self, previous: Spec, reply: str) -> Spec:
        out = self._length(self.w.output_len)
        messages = [*previous.messages, {"role": "assistant", "content": reply},
                    {"role": "user", "content": self._words(self._length(self.w.turn_len))}]
        return Spec(out, messages=messages, cancel_after=self._cancel(out), session=previous.session,
                    turn=previous.turn + 1)
