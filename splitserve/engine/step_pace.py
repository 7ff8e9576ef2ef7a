"""How many prompt tokens a step may carry beside decoding sequences, so that decode keeps its pace.

A step that runs a prompt chunk next to decoding sequences delays every one of their next tokens
by the chunk's cost: a 2,048-token chunk at a 1B model's prompt pace on two cores is seconds, so
each prompt that arrives would stall every stream that long (its ITL p99). The engine loop notes
each step's duration and what it carried (:meth:`StepPace.note`, on the loop's own clock) and
keeps two running averages: a decode-only step's seconds and a prompt token's seconds (in a mixed
step, what the step took beyond a decode step). :meth:`StepPace.prompt_budget` is the prompt
tokens whose cost is ``ratio`` decode steps, so a mixed step takes about ``1 + ratio`` times a
decode step (``--prompt-chunk-cost``, ``EngineConfig.prompt_chunk_cost``). A step with no
decoding sequence (a prefill worker's, an idle engine's first prompts) is not limited by it.

Nothing measured yet (a fresh worker) means no limit: the scheduler's ``max_batch_tokens`` holds.
The budget never falls below ``MIN_PROMPT_TOKENS``, so prompts always move. Small chunks cost more
per token than large ones; the average follows what the chunks actually cost, so the stall stays
bounded by measurement, not by a model of the machine.
"""

from __future__ import annotations

from typing import Optional

MIN_PROMPT_TOKENS = 16
"""The least a mixed step's prompt chunks may take: one page, so a prompt always progresses."""

WEIGHT = 0.2
"""Each new step's weight in the running averages (about the last five steps count)."""


class StepPace:
    """Running averages of a decode step's and a prompt token's seconds (the engine loop only)."""

    def __init__(self, ratio: float) -> None:
        """``ratio``: a mixed step's prompt chunks may cost this many decode steps (0: no limit)."""
        if not ratio >= 0 or ratio == float("inf"):
            raise ValueError(f"--prompt-chunk-cost must be a finite number >= 0, not {ratio!r}")
        self.ratio = ratio
        self.decode_s: Optional[float] = None  # a decode-only step's seconds
        self.token_s: Optional[float] = None  # a prompt token's seconds

    def note(self, decoding: int, prompt_tokens: int, seconds: float) -> None:
        """A step with ``decoding`` decoding sequences and ``prompt_tokens`` prompt (or recompute)
        tokens took ``seconds``."""
        if not seconds > 0 or seconds == float("inf"):
            return
        if prompt_tokens <= 0:
            if decoding > 0:
                self.decode_s = _average(self.decode_s, seconds)
            return
        beside = self.decode_s if decoding > 0 and self.decode_s is not None else 0.0
        if decoding > 0 and self.decode_s is None:
            return  # its prompt tokens' share is unknown until a decode step is measured
        self.token_s = _average(self.token_s, max(seconds - beside, 0.0) / prompt_tokens)

    def prompt_budget(self) -> Optional[int]:
        """Prompt tokens a step beside decoding sequences may carry; None: no limit."""
        if self.ratio == 0 or self.decode_s is None or not self.token_s:
            return None
        return max(MIN_PROMPT_TOKENS, int(self.ratio * self.decode_s / self.token_s))


def _average(old: Optional[float], new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
