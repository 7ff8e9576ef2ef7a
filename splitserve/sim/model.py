"""The simulated forward pass: deterministic tokens, KV that says whose it is, a cost in time.

The engine around it is the real :class:`~splitserve.engine.engine.LLMEngine` built from
:func:`fake_parts` instead of a checkpoint. Only ``runner.run(batch)`` is fake:

- **KV**: every token a step computes writes its slot of the real KV pool — the key a hash of the
  sequence's tokens up to it (:func:`chain`), the value its position — so a slot says which tokens
  it is the KV of, whichever room computed it, and the simulator checks every write that lands and
  every prompt decode starts from against the tokens of the room that owns the page
  (``invariants.py``);
- **tokens**: the logits of each sampling sequence peak at one token, a function of the key of its
  last slot: the answer depends on the KV, so KV that is not the prompt's gives another text
  (checked against :func:`reference_text`'s); the real sampler picks it;
- **time**: ``cost_s`` of the last step, proportional to its tokens (``cluster.py`` waits it).

The tokenizer is byte-level (:class:`ByteTokenizer`): token i < 256 is byte i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from splitserve.engine.engine import ModelParts
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.scheduler import ScheduledSeq
from splitserve.models.loader import ModelSpec

EOS = 256
VOCAB = 258
TAG_MOD = 1 << 52  # a float64 holds integers below 2**53 exactly


def chain_step(prev: float, token: int) -> float:
    """The key of the slot after one whose key is ``prev``, for ``token`` (exact in a float64)."""
    return float((int(prev) * 1_000_003 + token + 1) % TAG_MOD)


def chain(token_ids) -> list[float]:
    """The keys of the slots of ``token_ids``, from the first."""
    out, prev = [], 0.0
    for token in token_ids:
        prev = chain_step(prev, token)
        out.append(prev)
    return out


class ByteTokenizer:
    """Bytes in, bytes out: what the engine and the HTTP front end ask of a tokenizer."""

    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True, **kw):
        text = "".join(f"<{m.get('role')}>{m.get('content')}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


def next_token(key: float, eos_every: int) -> int:
    """The token that follows a slot whose key is ``key``: printable ASCII, or EOS about once in
    ``eos_every``."""
    h = int(key) & 0xFFFFFFFF
    h = (h ^ (h >> 15)) * 0x2C1B3C6D & 0xFFFFFFFF
    h = (h ^ (h >> 13)) * 0x297A2D39 & 0xFFFFFFFF
    if eos_every and h % eos_every == 0:
        return EOS
    return 32 + (h >> 8) % 95


@dataclass(frozen=True)
class Cost:
    """Simulated seconds a step takes: ``step_s`` + ``token_s`` per token computed."""

    step_s: float = 0.002
    token_s: float = 0.00005

    def of(self, tokens: int) -> float:
        return self.step_s + self.token_s * tokens


class FakeRunner:
    """``ModelRunner``'s place in the engine (module docstring)."""

    def __init__(self, model: "FakeModel", kv: KVPool, progress=None):
        self.model = model  # progress: unused (a simulated step takes no time on the loop's clock while it runs)
        self.kv = kv
        self.page_size = kv.layout.page_size
        self.slots = kv.buffer.numpy().reshape(kv.layout.num_pages, 2, self.page_size)  # a view: [page, k|v, slot]
        self.cost_s = 0.0  # of the last step
        self.tokens = 0  # computed by every step so far
        self.fail_next = 0  # steps that raise (a forward pass that fails: the engine fails its batch)
        self.on_fail = lambda: None

    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        n_tokens = sum(item.num_tokens for item in batch)
        self.cost_s = self.model.cost.of(n_tokens)
        self.tokens += n_tokens
        if self.fail_next:
            self.fail_next -= 1
            self.on_fail()
            raise RuntimeError("simulated forward-pass failure")
        size, rows, slots = self.page_size, [], self.slots
        for item in batch:
            seq = item.seq
            pos, end = seq.num_computed, seq.num_computed + item.num_tokens
            key = float(slots[seq.pages[(pos - 1) // size], 0, (pos - 1) % size]) if pos else 0.0
            tokens = seq.token_ids
            while pos < end:
                page, slot = seq.pages[pos // size], pos % size
                key = chain_step(key, tokens[pos])
                slots[page, 0, slot] = key
                slots[page, 1, slot] = pos
                pos += 1
            if item.samples:
                rows.append(next_token(key, self.model.eos_every))
        logits = np.zeros((len(rows), VOCAB), dtype=np.float32)  # numpy: a tenth of torch's cost at this size
        logits[range(len(rows)), rows] = 30.0
        return torch.from_numpy(logits)


@dataclass
class FakeModel:
    cost: Cost = Cost()
    eos_every: int = 24


def fake_spec(max_context: int = 4096) -> ModelSpec:
    return ModelSpec(name="sim", path="/nonexistent/sim-model", architecture="SimForCausalLM", num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=1, hidden_size=1, vocab_size=VOCAB,
                     max_context=max_context, dtype=torch.float64, eos_token_ids=(EOS,), generation_defaults={},
                     tie_word_embeddings=False)


def fake_parts(model: Optional[FakeModel] = None) -> ModelParts:
    return ModelParts(model or FakeModel(), fake_spec(), ByteTokenizer(), make_runner=FakeRunner)


def kv_of(kv: KVPool, pages: list[int], n_tokens: int) -> tuple[list[float], list[float]]:
    """The keys (room tags) and values (positions) of the first ``n_tokens`` slots of ``pages``."""
    slots = kv.buffer.numpy().reshape(kv.layout.num_pages, 2, kv.layout.page_size)[pages]  # [n, 2, size]
    return slots[:, 0, :].reshape(-1)[:n_tokens].tolist(), slots[:, 1, :].reshape(-1)[:n_tokens].tolist()
