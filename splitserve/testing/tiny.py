"""A built-in tiny model: random weights, real architectures, properties checked at build time
(``docs/tiny_model.md``: why the weights are drawn as they are, and what the check requires).

Shapes (float32 weights, vocab 2048, context 8192, 4 layers, hidden 256, MLP 768)::

    arch    heads kv-heads head_dim  tied  extras
    llama   8     2        32        no    rope_theta 1e4, rms_norm_eps 1e-5
    qwen2   8     2        32        yes   q/k/v bias, rope_theta 1e6
    qwen3   8     4        64        no    q/k RMSNorm, heads*head_dim (512) != hidden (256)

Tokenizer: a byte-level BPE trained at build time on a corpus from a fixed seed (any UTF-8 string
round-trips exactly), with ``<|pad|>`` 0, ``<|startoftext|>`` 1 (bos), ``<|endoftext|>`` 2 (eos,
which greedy decoding never emits), ``<|im_start|>`` 3, ``<|im_end|>`` 4, ``<tool_call>`` and
``</tool_call>`` (one added token each, the last two ids) and a ChatML-like chat template.

``tiny_model_path()`` is what ``--model tiny`` resolves to: built once per (arch, seed,
FORMAT_VERSION) into the model cache by ``splitserve.models.cache.build_once`` (locked, renamed
into place, rebuilt when incomplete or its report is not ``ok``); the builder tries candidate seeds
until one passes ``_check_model``. Bump FORMAT_VERSION whenever what the builder writes changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.models.cache import build_once, cache_root
from splitserve.models.resolve import TEST_MODEL_REPORT

FORMAT_VERSION = 4
ARCHS = ("llama", "qwen2", "qwen3")
VOCAB_SIZE = 2048
MAX_POSITION_EMBEDDINGS = 8192
SPECIAL_TOKENS = ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
# Tool-call tags are added tokens (one id each, kept by decode), as in Qwen's and Llama's
# tokenizers: not special, so skip_special_tokens leaves them in the text the parser reads.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
TOOL_CALL_ID, TOOL_CALL_END_ID = VOCAB_SIZE - 2, VOCAB_SIZE - 1
GAP_FACTOR = 100.0  # required min top-1/top-2 gap, in units of the measured batch-shape error
MAX_SEED_TRIES = 32
REPORT_NAME = TEST_MODEL_REPORT  # how the runtime tells a test model (models/resolve.py)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, and tools as Qwen2.5's template renders them (Hermes' format): the functions in the
system turn, an assistant's calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
(what ``server/tool_calls.py`` parses), tool results as a user turn of ``<tool_response>``s.
Without tools it renders what it always did."""

_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", REPORT_NAME)


class TinyModelCheckError(RuntimeError):
    """No candidate seed produced a model that passes the build-time checks."""


@dataclass(frozen=True)
class _Scales:
    """Init scales: each weight ~ N(0, (s / sqrt(fan_in))^2), so a projection of an O(1) input
    has O(1) outputs times s. `special_row` multiplies the special tokens' unembedding rows."""

    embed: float = 0.5
    qk: float = 1.3
    vo: float = 1.0
    mlp: float = 1.0
    bias: float = 0.1
    qk_norm: float = 1.0  # qwen3's per-head q/k RMSNorm weight: the attention sharpness there
    lm_head: float = 4.0  # logit standard deviation
    special_row: float = 0.0


@dataclass(frozen=True)
class _Arch:
    config_kwargs: dict
    scales: _Scales


_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=8, max_position_embeddings=MAX_POSITION_EMBEDDINGS, hidden_act="silu",
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, use_cache=True,
)
_ARCHS = {
    "llama": _Arch(
        dict(_COMMON, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        _Scales(),
    ),
    "qwen2": _Arch(
        dict(_COMMON, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
             use_sliding_window=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Tied: logits = embed @ h; a small embedding keeps the current token's own direction a
        # minor part of the residual stream (see the module docstring); the final-norm weight
        # restores the logit scale.
        _Scales(embed=0.04, qk=1.15, special_row=0.1),
    ),
    "qwen3": _Arch(
        dict(_COMMON, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        _Scales(qk_norm=1.2),
    ),
}


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

_TEXT = """\
The server reads a prompt, runs it through the model once, and then produces one token at a
time. Each request waits in a queue, holds a few pages of the key-value cache, and is released
exactly once when it finishes. A request that is aborted, timed out or failed must say so in the
log, with its id, its room, the state it was in and how long it had waited.
Le serveur lit une requête, calcule le préfixe puis génère les jetons un par un. Der Server
liest die Anfrage, berechnet den Präfix und erzeugt dann die Token nacheinander. El servidor
lee la petición y genera la respuesta. 服务器读取请求，然后逐个生成词元。サーバーは要求を読み、
トークンを一つずつ生成します。서버는 요청을 읽고 토큰을 하나씩 생성합니다. Ἐν ἀρχῇ ἦν ὁ λόγος.
Emoji: 🙂 🚀 ✅ ❤️ 👍🏽 — “quotes”, ‘single’, «guillemets», naïve café, résumé, über, façade.
"""

_CODE = """\
def allocate(self, num_pages: int) -> list[int]:
    if not self.can_allocate(num_pages):
        raise MemoryError(f"need {num_pages} pages, have {len(self.free)}")
    pages, self.free = self.free[:num_pages], self.free[num_pages:]
    return pages

for i in range(10):
    print(i, i * i, {"id": i, "ok": True, "name": "item-%d" % i})
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
"""


def _corpus() -> list[str]:
    """Fixed text plus seeded pseudo-text: enough material for 2,043 merges, deterministic."""
    rng = random.Random(20240611)
    words = _TEXT.split() + _CODE.split()
    syllables = ("ka ri to ne mu sa lo vi en an or th er in st ch qu sh ph ing ed ly tion al "
                 "re de con pro ment ness able ous ive est ter per com ex im un").split()
    pseudo = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(1500)]
    lines = [_TEXT] * 4 + [_CODE] * 4
    for _ in range(600):
        n = rng.randint(5, 25)
        ws = [rng.choice(words) if rng.random() < 0.4 else rng.choice(pseudo) for _ in range(n)]
        if rng.random() < 0.2:
            ws.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(ws).capitalize() + rng.choice([".", "!", "?", ",", ":", ""]) + "\n")
    return lines


def _train_tokenizer():
    """Byte-level BPE of exactly VOCAB_SIZE entries: special tokens at ids 0..4, tool tags last."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS), min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} entries, want {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    for i, t in zip((TOOL_CALL_ID, TOOL_CALL_END_ID), TOOL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def _save_tokenizer(tok, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS[PAD_ID], bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID], extra_special_tokens=[SPECIAL_TOKENS[IM_START_ID],
                                                                SPECIAL_TOKENS[IM_END_ID]],
        clean_up_tokenization_spaces=False, model_max_length=MAX_POSITION_EMBEDDINGS,
        chat_template=CHAT_TEMPLATE,
    )
    # save_jinja_files=False: the template goes into tokenizer_config.json, not a separate file.
    fast.save_pretrained(str(out_dir), save_jinja_files=False)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

def _candidate_seed(seed: int, attempt: int) -> int:
    """The seed itself first, then a fixed hash-derived sequence (independent of the machine)."""
    if attempt == 0:
        return seed
    digest = hashlib.sha256(f"splitserve-tiny:{seed}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _model_classes(arch: str):
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    return getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")


def _init_model(arch: str, seed: int):
    """Construct the model and draw every parameter from one torch.Generator, in name order."""
    import torch

    spec = _ARCHS[arch]
    config_cls, model_cls = _model_classes(arch)
    config = config_cls(**spec.config_kwargs)
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):  # transformers' own init must not move global RNG
        model = model_cls(config).to(torch.float32).eval()
    s = spec.scales
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):  # tied lm_head appears once, as embed
            fan_in = p.shape[-1]
            if name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
                p.fill_(s.qk_norm)
            elif name.endswith("model.norm.weight") and config.tie_word_embeddings:
                # logits = w * norm(h) @ embed.T, rows of norm ~embed*16: std = w * embed * 16
                p.fill_(s.lm_head / (s.embed * math.sqrt(config.hidden_size)))
            elif "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * s.bias)
            else:
                if "embed_tokens" in name:
                    std = s.embed
                elif "lm_head" in name:
                    std = s.lm_head / math.sqrt(fan_in)
                elif any(k in name for k in ("q_proj", "k_proj")):
                    std = s.qk / math.sqrt(fan_in)
                elif any(k in name for k in ("v_proj", "o_proj")):
                    std = s.vo / math.sqrt(fan_in)
                elif "mlp" in name:
                    std = s.mlp / math.sqrt(fan_in)
                else:
                    raise RuntimeError(f"tiny model: no init rule for parameter {name}")
                p.copy_(torch.randn(p.shape, generator=g) * std)
        out_rows = model.get_output_embeddings().weight
        out_rows[: len(SPECIAL_TOKENS)] *= s.special_row
    return model


# --------------------------------------------------------------------------------------------
# Build-time check
# --------------------------------------------------------------------------------------------

_SHORT_LENGTHS = (1, 20, 128, 300)
_BATCH_STEPS = 32  # greedy steps for the batch of short probes
_SOLO_STEPS = 64  # ... for the 300-token probe decoded alone (the repetition-loop check)
_LONG_LENGTH = 3000
_LONG_STEPS = 8
_CONTEXT_OFFSET = 100  # the altered 300-token probe differs this far from its end
_MIN_DISTINCT = 16  # distinct tokens required in the 64-token continuation
_BASE = len(_SHORT_LENGTHS) - 1  # batch index of the 300-token probe; its altered twin follows


def _probe_prompts(tok) -> list[list[int]]:
    """Short probes, in batch order: random-token prompts, the altered twin of the 300-token
    one, and a ChatML conversation (special tokens as inputs)."""
    rng = random.Random(1234)
    lo = len(SPECIAL_TOKENS)
    prompts = [[rng.randrange(lo, VOCAB_SIZE) for _ in range(n)] for n in _SHORT_LENGTHS]
    altered = list(prompts[_BASE])
    i = len(altered) - _CONTEXT_OFFSET
    altered[i] = lo + (altered[i] - lo + 1 + rng.randrange(VOCAB_SIZE - lo - 1)) % (VOCAB_SIZE - lo)
    prompts.append(altered)
    chat = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in (
        ("system", "You are a helpful assistant."),
        ("user", "Summarise the lifecycle of a request, please. 🙂"),
    )) + "<|im_start|>assistant\n"
    prompts.append([BOS_ID] + tok.encode(chat).ids)
    return prompts


def _greedy(model, prompts: list[list[int]], steps: int):
    """Greedy decode of a left-padded batch with a KV cache: the prompt in one forward, then
    one token per forward. Returns the tokens [B, steps] and the logits [B, steps, V] that each
    token was chosen from."""
    import torch

    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), PAD_ID, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                logits_to_keep=1)
    cache, logits, tokens = out.cache, [out.logits[:, -1]], []
    for t in range(steps):
        nxt = logits[-1].argmax(-1)  # [B]
        tokens.append(nxt)
        if t == steps - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=mask,
                    position_ids=mask.sum(-1, keepdim=True) - 1, cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[:, -1])
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def _forced_alone(model, seq: list[int], steps: int):
    """Logits [steps, V] that predict the last `steps` tokens of seq: one forward, no cache."""
    import torch

    return model(input_ids=torch.tensor([seq[:-1]]), logits_to_keep=steps).logits[0]


def _forced_right_padded(model, seqs: list[list[int]], steps: int):
    """The same as _forced_alone for all seqs at once, in one right-padded batch."""
    import torch

    B, L = len(seqs), max(len(s) - 1 for s in seqs)
    ids = torch.full((B, L), PAD_ID, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s) - 1] = torch.tensor(s[:-1])
        mask[b, : len(s) - 1] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    return [logits[b, len(s) - 1 - steps: len(s) - 1] for b, s in enumerate(seqs)]


class _Margins:
    """Accumulates, over groups of runs that compute the same decoding steps in different batch
    shapes: the largest logit difference between runs, the smallest top-1/top-2 gap, the
    smallest lead of the top-1 over every special token, and whether every run's argmax is the
    token greedy decoding chose."""

    def __init__(self):
        self.max_error, self.min_gap, self.min_special_margin = 0.0, math.inf, math.inf
        self.steps, self.same_tokens = 0, True

    def add(self, tokens, runs, new_steps: bool = True) -> None:
        n_special = len(SPECIAL_TOKENS)
        self.steps += len(tokens) if new_steps else 0
        for run in runs:
            self.max_error = max(self.max_error, (run - runs[0]).abs().max().item())
            top2 = run.topk(2, dim=-1).values  # [steps, 2]
            self.min_gap = min(self.min_gap, (top2[:, 0] - top2[:, 1]).min().item())
            special = run[:, :n_special].max(-1).values
            self.min_special_margin = min(self.min_special_margin,
                                          (top2[:, 0] - special).min().item())
            self.same_tokens &= bool((run.argmax(-1) == tokens).all())

    @property
    def ratio(self) -> float:
        return self.min_gap / self.max_error if self.max_error > 0 else math.inf

    def checks(self) -> dict:
        return {
            "same_greedy_tokens_in_all_runs": self.same_tokens,
            "gap_over_error": self.ratio > GAP_FACTOR,
            "special_tokens_never_close": self.min_special_margin > GAP_FACTOR * self.max_error,
        }


def _check_model(model, tok) -> dict:
    """Run the probes; return the measurements and `ok`. See the module docstring. Stops after
    the batch of short probes if that already fails (most failing seeds do)."""
    import torch

    m = _Margins()
    checks: dict = {}
    report: dict = {}
    with torch.inference_mode():
        # 1. Short probes: batch with a cache vs. each alone in one pass vs. right-padded batch.
        prompts = _probe_prompts(tok)
        gen, dec = _greedy(model, prompts, _BATCH_STEPS)
        seqs = [p + g.tolist() for p, g in zip(prompts, gen)]
        padded = _forced_right_padded(model, seqs, _BATCH_STEPS)
        for i, s in enumerate(seqs):
            m.add(gen[i], [_forced_alone(model, s, _BATCH_STEPS), dec[i], padded[i]])
        base, altered = gen[_BASE].tolist(), gen[_BASE + 1].tolist()
        diverge = next((t for t, (a, b) in enumerate(zip(base, altered)) if a != b), None)
        checks["context_changes_continuation"] = diverge is not None
        report["context_divergence_step"] = diverge
        if all(m.checks().values()) and all(checks.values()):
            # 2. The 300-token probe alone with a cache, 64 steps: its first steps must match
            #    the batch's; the continuation must not be a repetition loop.
            solo_gen, solo = _greedy(model, [prompts[_BASE]], _SOLO_STEPS)
            m.add(gen[_BASE], [dec[_BASE], solo[0, :_BATCH_STEPS]], new_steps=False)
            m.add(solo_gen[0], [_forced_alone(model, prompts[_BASE] + solo_gen[0].tolist(),
                                              _SOLO_STEPS), solo[0]])
            distinct = len(set(solo_gen[0].tolist()))
            checks["no_repetition_loop"] = distinct >= _MIN_DISTINCT
            report["distinct_tokens_in_64"] = distinct
            # 3. A long prompt alone: prefill + decode with a cache vs. one pass.
            rng = random.Random(4321)
            long_prompt = [rng.randrange(len(SPECIAL_TOKENS), VOCAB_SIZE)
                           for _ in range(_LONG_LENGTH)]
            t0 = time.perf_counter()
            long_gen, long_dec = _greedy(model, [long_prompt], _LONG_STEPS)
            report["long_prompt_prefill_and_decode_s"] = round(time.perf_counter() - t0, 3)
            long_seq = long_prompt + long_gen[0].tolist()
            m.add(long_gen[0], [_forced_alone(model, long_seq, _LONG_STEPS), long_dec[0]])
    checks = {**m.checks(), **checks}
    if "no_repetition_loop" not in checks:
        checks["completed_all_probes"] = False
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "min_gap": m.min_gap,
        "max_error": m.max_error,
        "gap_over_error": m.ratio,
        "gap_factor_required": GAP_FACTOR,
        "min_special_margin": m.min_special_margin,
        "decoded_steps_checked": m.steps,
        "long_prompt_tokens": _LONG_LENGTH,
        **report,
    }


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def build_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0) -> Path:
    """Write a checked tiny `arch` checkpoint (weights, config, generation config, tokenizer,
    chat template, report) into `out_dir` and return its path. Deterministic in (arch, seed)."""
    import torch
    from transformers import GenerationConfig

    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose one of {', '.join(ARCHS)}")
    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer()
    attempts = []
    with _one_torch_thread():
        for attempt in range(MAX_SEED_TRIES):
            candidate = _candidate_seed(seed, attempt)
            model = _init_model(arch, candidate)
            report = _check_model(model, tok)
            attempts.append({"seed": candidate, "ok": report["ok"],
                             "gap_over_error": report["gap_over_error"],
                             "failed": [k for k, v in report["checks"].items() if not v]})
            if report["ok"]:
                break
    if not report["ok"]:
        raise TinyModelCheckError(
            f"tiny {arch} model: none of {MAX_SEED_TRIES} candidate seeds derived from seed "
            f"{seed} passed the build-time checks: {attempts}")

    with _progress_bars_off():
        model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID],
                     pad_token_id=PAD_ID).save_pretrained(str(out))
    _save_tokenizer(tok, out)
    report.update({
        "format_version": FORMAT_VERSION, "arch": arch, "seed": seed,
        "effective_seed": candidate, "attempts": attempts,
        "build_s": round(time.perf_counter() - t_start, 3),
        "torch": torch.__version__, "transformers": _transformers_version(),
    })
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return out


def tiny_model_cache_dir() -> Path:
    """Where `tiny_model_path` keeps its builds: $SPLITSERVE_CACHE, else ~/.cache/splitserve."""
    return cache_root()


def tiny_model_path(arch: str = "llama", seed: int = 0) -> Path:
    """The tiny model `--model tiny` means: built once per (arch, seed, FORMAT_VERSION) into the
    cache folder and reused. Safe to call from many processes at once: one builds under an
    fcntl lock into a temporary folder renamed into place; the others wait, then reuse it
    (`splitserve.models.cache.build_once`)."""
    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose one of {', '.join(ARCHS)}")
    final = tiny_model_cache_dir() / f"tiny-{arch}-seed{seed}-v{FORMAT_VERSION}"
    # build_tiny_model looked up at call time: tests replace it
    return build_once(final, lambda tmp: build_tiny_model(tmp, arch=arch, seed=seed), _is_complete)


def _is_complete(path: Path) -> bool:
    if not all((path / f).is_file() for f in _MODEL_FILES):
        return False
    try:
        report = json.loads((path / REPORT_NAME).read_text())
    except (OSError, ValueError):
        return False
    return report.get("ok") is True and report.get("format_version") == FORMAT_VERSION


@contextlib.contextmanager
def _one_torch_thread():
    """The check is ~100 decode-sized forwards: a second thread gains little, and when the
    cores are shared (tests start several servers at once) every op waits for both threads to
    be scheduled, making a 1 s build take 10-30 s. Measured results are the same either way.
    Process-global, restored afterwards: builds happen at startup, before serving."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _progress_bars_off():
    """save_pretrained draws a progress bar on stderr; a library call should not."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
