"""Where an engine step's time goes at a model shape, for three kinds of step: one decoding
sequence, ``--batch`` decoding sequences (each with ``--context`` tokens of context), and one
``--chunk``-token prompt chunk. Each step is split into the matmuls by kind (``qkv``: q|k|v as
one merged matmul, ``o``, ``gate_up``: gate|up as one, ``down``, ``lm_head``), the paged
attention, sampling (what ``engine.step`` does after the forward pass and the logits, but the
detokenizer) and the rest (the residual: scheduler, the runner's batch and metadata, embedding,
norms, rope and the KV store, the SwiGLU gate, the layers' Python, the detokenizer; in detail).

Timed with ``time.perf_counter`` in forward hooks on the projection and embedding modules, and in
wrappers around what hooks cannot see: the model's per-layer ops (attention, norms, rope are
calls on ``model.ops``, not modules), ``compute_logits`` (a tied head is the embedding's weight
in a matmul, no module), the runner's ``run`` and each sequence's detokenizer. Each kind is
warmed up, then ``--repeat`` steps with the timers alternate with as many without them: medians
of both are printed, so the timers' own cost is visible. Usage::

    .venv/bin/python bench/profile_step.py (--shape 0.5b|1b|3b | --model PATH) [--repeat 5]
        [--context 376] [--batch 16] [--chunk 512] [--temperature 0] [--result-json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

import torch

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import GenerateRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_refs import cpu_description  # noqa: E402

MATMULS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
OPS = {"decode_attention": "attention", "prefill_attention": "attention", "add_rms_norm": "norms",
       "rope_tables": "rope_kv_store", "rope_store": "rope_kv_store", "silu_mul": "silu_mul"}
PARTS = ("qkv", "o", "gate_up", "down", "lm_head", "attention", "sampling", "rest")
REST = ("scheduler", "runner_other", "embedding", "norms", "rope_kv_store", "silu_mul", "layers_other",
        "detokenize")
REST_NAMES = {"scheduler": "engine before the forward (scheduler)",
              "runner_other": "runner: batch, metadata, logits rows",
              "embedding": "embedding", "norms": "norms (add_rms_norm)", "rope_kv_store": "rope + KV store",
              "silu_mul": "SwiGLU gate (silu_mul)", "layers_other": "layers' other Python (hooks included)",
              "detokenize": "detokenizer and stop strings (after sampling)"}


class TimedOps:
    """``model.ops`` with its per-layer calls timed into ``add(part, seconds)``; the rest delegated."""

    def __init__(self, ops, add: Callable[[str, float], None]):
        self.inner, self.add = ops, add

    def __getattr__(self, name: str):
        value = getattr(self.inner, name)
        return timed(value, OPS[name], self.add) if name in OPS else value


def timed(fn: Callable, part: str, add: Callable[[str, float], None], marks: Optional[dict] = None) -> Callable:
    """``fn`` adding its seconds to ``part`` (and, with ``marks``, leaving its start and end there)."""

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            add(part, t1 - t0)
            if marks is not None:
                marks[part] = (t0, t1)

    return call


class Probe:
    """The timers on one engine's model and runner; ``attach`` before a step, ``detach`` after."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.runner, self.model = engine, engine.runner, engine.runner.model
        self.seconds: dict[str, float] = defaultdict(float)
        self.marks: dict[str, tuple[float, float]] = {}
        self.handles: list = []
        self.ops = None
        self.detoks: list = []

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def hook(self, module: torch.nn.Module, part: str) -> None:
        start: list[float] = []
        self.handles.append(module.register_forward_pre_hook(lambda m, a: start.append(time.perf_counter())))
        self.handles.append(module.register_forward_hook(
            lambda m, a, out: self.add(part, time.perf_counter() - start.pop())))

    def attach(self) -> None:
        self.seconds.clear()
        self.marks.clear()
        for name, module in self.model.named_modules():
            leaf = name.rpartition(".")[2]
            if leaf in MATMULS:
                self.hook(module, MATMULS[leaf])
            elif leaf == "embed_tokens":
                self.hook(module, "embedding")
        self.hook(self.model, "forward")
        self.ops, self.model.ops = self.model.ops, TimedOps(self.model.ops, self.add)
        # instance attributes shadow the methods until detach (an untied head's Linear runs inside)
        self.model.compute_logits = timed(self.model.compute_logits, "lm_head", self.add)
        self.runner.run = timed(self.runner.run, "run", self.add, self.marks)
        self.detoks = [s.detok for s in self.engine.sequences().values() if getattr(s, "detok", None) is not None]
        for d in self.detoks:  # the text of each new token, after sampling
            d.add, d.release = timed(d.add, "detokenize", self.add), timed(d.release, "detokenize", self.add)

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.model.ops = self.ops
        del self.model.compute_logits
        del self.runner.run
        for d in self.detoks:
            del d.add, d.release
        self.detoks.clear()

    def breakdown(self, t0: float, t1: float) -> dict[str, float]:
        """One step from ``t0`` to ``t1``: every part's seconds, the rest's detail and ``step``."""
        s = self.seconds
        run_start, run_end = self.marks["run"]
        out = {p: s[p] for p in ("qkv", "o", "gate_up", "down", "lm_head", "attention")}
        out["sampling"] = t1 - run_end - s["detokenize"]
        out["scheduler"] = run_start - t0
        out["runner_other"] = s["run"] - s["forward"] - s["lm_head"]
        out.update({p: s[p] for p in ("embedding", "norms", "rope_kv_store", "silu_mul", "detokenize")})
        inside = sum(s[p] for p in ("qkv", "o", "gate_up", "down", "attention", "embedding", "norms",
                                    "rope_kv_store", "silu_mul"))
        out["layers_other"] = s["forward"] - inside
        out["rest"] = sum(out[p] for p in REST)
        out["step"] = t1 - t0
        return out


def step_once(engine: LLMEngine, probe: Optional[Probe], expect: tuple[int, int]) -> dict[str, float]:
    """One engine step, with the timers (``probe``) or bare ({"step": seconds}); ``expect``:
    (sequences scheduled, of them decoding) the step must have had, else the profile is wrong."""
    if probe is not None:
        probe.attach()
    try:
        t0 = time.perf_counter()
        report = engine.step()
        t1 = time.perf_counter()
    finally:
        if probe is not None:
            probe.detach()
    if (report.scheduled, report.decoding) != expect:
        raise RuntimeError(f"the step ran {report.scheduled} sequences, {report.decoding} decoding; "
                           f"expected {expect[0]}, {expect[1]} decoding")
    return probe.breakdown(t0, t1) if probe is not None else {"step": t1 - t0}


def random_prompt(rng: random.Random, engine: LLMEngine, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, engine.spec.vocab_size) for _ in range(n))


def decode_tokens(args, batch: int) -> int:
    """Tokens a decoding sequence may need: one per step of the others' prompts (the first to
    finish its prompt decodes meanwhile), of the warm-up and of the timed and bare steps."""
    return -(-batch * args.context // max(args.chunk, batch)) + batch + args.warmup + 2 * args.repeat + 2


def decode_kind(engine: LLMEngine, args, batch: int, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """``batch`` sequences with ``args.context`` prompt tokens each, computed untimed; then warm-up
    decode steps and ``args.repeat`` timed ones, each followed by a bare one."""
    params = SamplingParams(temperature=args.temperature, max_tokens=decode_tokens(args, batch), ignore_eos=True,
                            seed=0)
    rids = [f"decode{batch}-{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(GenerateRequest(rid, random_prompt(rng, engine, args.context), params))
    for _ in range(batch * args.context + 2):  # the prompts, until a step decodes every sequence
        report = engine.step()
        if (report.scheduled, report.decoding) == (batch, batch):
            break
    else:
        raise RuntimeError(f"{batch} sequences never decoded together")
    probe, probed, bare = Probe(engine), [], []
    for _ in range(args.warmup):
        step_once(engine, probe, (batch, batch))
    for _ in range(args.repeat):
        probed.append(step_once(engine, probe, (batch, batch)))
        bare.append(step_once(engine, None, (batch, batch)))
    for rid in rids:
        engine.abort(rid)
    engine.flush_cache()
    return probed, bare


def prompt_kind(engine: LLMEngine, args, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """One prompt of ``args.chunk`` tokens from its start, in one step (its first token sampled):
    a warm-up one, then ``args.repeat`` timed ones alternating with bare ones."""
    params = SamplingParams(temperature=args.temperature, max_tokens=1, ignore_eos=True, seed=0)
    probe, probed, bare = Probe(engine), [], []
    for i in range(1 + 2 * args.repeat):
        rid = f"prompt-{i}"
        engine.add_request(GenerateRequest(rid, random_prompt(rng, engine, args.chunk), params))
        with_probe = i == 0 or i % 2 == 1  # the first: a warm-up
        timing = step_once(engine, probe if with_probe else None, (1, 0))
        if i:
            (probed if with_probe else bare).append(timing)
        engine.abort(rid)
        engine.flush_cache()
    return probed, bare


def summary(probed: list[dict], bare: list[dict], tokens: int) -> dict:
    """Medians: every part and the rest's detail; ``rest`` is the residual, so the parts add up
    to the timed step's median (``rest_other``: what the rest's detail medians leave of it)."""
    med = {k: statistics.median(row[k] for row in probed) for k in probed[0]}
    parts = {p: med[p] for p in PARTS if p != "rest"}
    parts["rest"] = med["step"] - sum(parts.values())
    detail = {p: med[p] for p in REST}
    detail["rest_other"] = parts["rest"] - sum(detail.values())
    bare_s = statistics.median(row["step"] for row in bare)
    return {"tokens": tokens, "step_s": med["step"], "bare_step_s": bare_s, "parts": parts, "rest_detail": detail,
            "steps": len(probed)}


def build_engine(args) -> tuple[LLMEngine, str]:
    if args.shape:
        from splitserve.models.make_model import cached_gguf

        model = str(cached_gguf(args.shape, args.gguf_type))
    else:
        model = args.model
    pool = args.batch * (args.context + decode_tokens(args, args.batch) + 16) + args.chunk + 64
    config = EngineConfig(model=model, dtype=args.dtype, quantization=args.quantization,
                          max_running_requests=max(args.batch, 1), max_batch_tokens=max(args.chunk, args.batch),
                          max_total_tokens=pool, prompt_chunk_cost=0.0)
    return LLMEngine(config), model


def machine() -> dict:
    return {"cpu": cpu_description(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def print_table(result: dict) -> None:
    kinds = result["kinds"]
    print(f"{'ms per step, share':<48}" + "".join(f"{name:>20}" for name in kinds))
    rows = [(p, p, "parts") for p in PARTS] + [("  " + REST_NAMES[p], p, "rest_detail") for p in REST]
    rows.append(("  other (residual of the medians)", "rest_other", "rest_detail"))
    for label, key, where in rows:
        cells = ""
        for k in kinds.values():
            s = k[where][key]
            cells += f"{s * 1e3:>12.3f} {100 * s / k['step_s']:>6.1f}%"
        print(f"{label:<48}{cells}")
    print(f"{'step, timed (the parts add up to it)':<48}" + "".join(f"{k['step_s'] * 1e3:>12.3f} {100.0:>6.1f}%"
                                                               for k in kinds.values()))
    print(f"{'step, without the timers':<48}" + "".join(
        f"{k['bare_step_s'] * 1e3:>12.3f} {100 * k['bare_step_s'] / k['step_s']:>6.1f}%" for k in kinds.values()))
    print(f"{'tokens per second (untimed steps)':<48}" + "".join(
        f"{k['tokens'] / k['bare_step_s']:>20.1f}" for k in kinds.values()))


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from splitserve.models.shapes import BENCH_SHAPES, SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--shape", choices=[*BENCH_SHAPES, *SHAPES],
                       help="a named shape's random GGUF file (made once into the model cache; "
                       + ", ".join(f"{k} = {v}" for k, v in BENCH_SHAPES.items()) + ")")
    which.add_argument("--model", help="a GGUF file, a Hugging Face folder, or tiny / smollm2")
    ap.add_argument("--gguf-type", default="Q4_0", help="the --shape file's type (default: %(default)s, "
                    "what bench/vs_refs.py serves)")
    ap.add_argument("--quantization", default="auto", help="splitserve's --quantization (default: %(default)s)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps of each kind (medians printed)")
    ap.add_argument("--warmup", type=int, default=2, help="decode steps before the timed ones")
    ap.add_argument("--context", type=int, default=376, help="prompt tokens of each decoding sequence")
    ap.add_argument("--batch", type=int, default=16, help="decoding sequences of the batched kind")
    ap.add_argument("--chunk", type=int, default=512, help="tokens of the prompt-chunk kind")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling's (default 0: greedy, as vs_refs)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--result-json", type=Path, default=None)
    args = ap.parse_args(argv)
    if min(args.repeat, args.context, args.batch) < 1 or args.chunk < 2 or args.warmup < 0:
        ap.error("--repeat, --context and --batch must be at least 1, --chunk at least 2, --warmup at least 0")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine, model = build_engine(args)
    rng = random.Random(0)
    kinds = {}
    for batch in sorted({1, args.batch}):
        kinds[f"decode x{batch}"] = summary(*decode_kind(engine, args, batch, rng), tokens=batch)
    kinds[f"prompt {args.chunk}"] = summary(*prompt_kind(engine, args, rng), tokens=args.chunk)
    result = {"model": model, "dtype": str(engine.spec.dtype).removeprefix("torch."),
              "quantization": args.quantization, "ops": engine.runner.model.ops.name, "context": args.context,
              "temperature": args.temperature, "repeat": args.repeat, "machine": machine(), "kinds": kinds}
    m = result["machine"]
    print(f"model {model}, dtype {result['dtype']}, --quantization {args.quantization}, ops {result['ops']}; "
          f"decoding sequences hold {args.context}+ tokens of context; medians of {args.repeat} steps each")
    print(f"CPU: {m['cpu']}; {m['cpus']} CPUs, torch threads {m['torch_threads']}; "
          f"load average {' '.join(map(str, m['load_average']))} at the end")
    print_table(result)
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
