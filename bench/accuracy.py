"""What serving a GGUF file's quantized weights as they are costs in accuracy, in one run.

The reference is the dequantized float32 model of the same file (``--quantization none``: every
weight expanded exactly as the ``gguf`` library dequantizes it; the only full-precision SmolLM2
here). Against it, each ``--modes`` entry (default ``auto``: the file's Q4_1 / Q8_0 blocks kept,
the activations rounded to int8 per block of 32, as llama.cpp does) is measured two ways:

- greedy agreement over a fixed prompt set (``PROMPTS``, chat-formatted, ``--new-tokens`` each):
  the share of generated tokens that agree with the reference before the first divergence, and how
  many answers agree whole;
- perplexity on a text shipped with the bench, ``bench/data/lighthouses.txt`` (about 1,000 words
  of plain English prose written for it), as one sequence, its prompt chunks of ``--chunk`` tokens;
- per position of that text, against the reference's next-token distribution (what llama.cpp's
  ``perplexity --kl-divergence`` reports): the mean KL divergence KL(reference || mode), its 99th
  percentile, and the share of positions whose top-1 token is the reference's. Unlike greedy
  agreement these do not stop at a first divergence: every position is scored on the same context.

Bounds (the bench prints each check and exits 1 when one fails): perplexity at most ``PPL_BOUND``
times the reference's, mean KL divergence at most ``KLD_BOUND`` and the same top-1 token at least
``TOP1_BOUND`` of the positions; greedy agreement is printed, not bounded (it is chaotic: below).
When llama.cpp's venv is
there (``bench/refs/setup_llamacpp.sh``; ``--llamacpp-python`` or ``$SPLITSERVE_REF_LLAMACPP``),
llama.cpp's perplexity on the same file and the same tokens (llama-cpp-python with
``logits_all``; its full logits come back through a temporary ``.npy`` file, not JSON) is printed
beside ours, with the same KL divergence and top-1 figures, as the reference for the quantized
arithmetic.

``--kv-cache-dtype int8`` measures the KV cache instead: the reference is then the model as it is
served (``--quantization auto``, ``--kv-dtype``: bfloat16 by default) with pages of its own dtype,
against the same model with int8 pages, by the same figures and bounds. Usage::

    .venv/bin/python bench/accuracy.py [--model smollm2|PATH.gguf] [--modes auto,int8] [--new-tokens 96]
    .venv/bin/python bench/accuracy.py --kv-cache-dtype int8 [--kv-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import GenerateRequest, SamplingParams
from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.layers.attention import build_metadata
from splitserve.models.loader import load_tokenizer
from splitserve.models.resolve import resolve_model_dir

TEXT = Path(__file__).with_name("data") / "lighthouses.txt"
PPL_BOUND = 1.03  # perplexity of a mode / the reference's
# The share of greedy tokens before the first divergence is not bounded: a 135M model's greedy
# answers meet near-ties early, one flipped token changes the rest, and any float32-level change
# re-draws which near-ties flip (auto with its embeddings scaled by 1 + 2^-22 at random entries:
# 13-36% over 6 seeds, perplexity 1.0004-1.0046x; llama.cpp itself 25-44% and 1.0006-1.0050x
# between its KV-cache and flash-attention settings). The per-position KL divergence and top-1
# share are the stable figures (those seeds: KLD 0.0026-0.0028, top-1 95.4-96.9%; llama.cpp on the
# same file 0.0027 and 96.2%; int8 0.0038 and 95.2%), and a perplexity ratio's standard error
# (printed) says how far chance moves that ratio.
KLD_BOUND = 0.01  # mean KL(reference || mode) a position, nats
TOP1_BOUND = 0.93  # positions whose top-1 token is the reference's
DEFAULT_LLAMACPP = "/work/refs/llamacpp/bin/python"
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a prime number is to a ten-year-old.",
    "List three uses of a paperclip.",
    "How does a refrigerator keep food cold?",
    "Give me a recipe for a simple tomato soup.",
    "What are the main differences between a cat and a dog as pets?",
    "Summarize the plot of a detective story in three sentences.",
    "Why is the sky blue?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "What should I pack for a weekend hiking trip?",
    "Describe how to change a flat bicycle tyre.",
]


def gguf_source(model: str) -> Path:
    from splitserve.models.gguf import find_gguf
    from splitserve.models.resolve import smollm2_gguf

    src = smollm2_gguf() if model == "smollm2" else find_gguf(model)
    if src is None:
        raise SystemExit(f"--model {model!r} is not a GGUF file: the reference is a GGUF file's dequantized model")
    return src


def engine_for(model_dir: str, mode: str, args, dtype: str = "float32", kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=dtype, quantization=mode, kv_cache_dtype=kv_cache_dtype,
                                  max_running_requests=len(PROMPTS), max_total_tokens=8192,
                                  max_batch_tokens=max(2048, args.chunk)))


def greedy(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    reqs = [GenerateRequest(f"g{i}", tuple(p), params) for i, p in enumerate(prompts)]
    outs = engine.generate(reqs)
    return [list(outs[r.rid].token_ids) for r in reqs]


@torch.inference_mode()
def text_logprobs(engine: LLMEngine, tokens: list[int], chunk: int) -> torch.Tensor:
    """log p(. | tokens[:i + 1]) for i < len(tokens) - 1: float32 [len(tokens) - 1, vocab], the text
    as one sequence in prompt chunks of ``chunk`` tokens, through the engine's model and ops."""
    model, spec = engine.runner.model, engine.spec
    page = engine.runner.page_size
    pages = list(range(-(-len(tokens) // page)))
    kv = KVPool(KVLayout(len(pages), spec.num_layers, page, spec.num_kv_heads, spec.head_dim, spec.dtype,
                         engine.layout.kv_cache_dtype))
    out: Optional[torch.Tensor] = None
    for start in range(0, len(tokens) - 1, chunk):
        piece = tokens[start:start + chunk]
        meta = build_metadata([(start, len(piece), pages)], page, dtype=spec.dtype)
        hidden = model(torch.tensor(piece), torch.arange(start, start + len(piece)), meta, kv)
        logprobs = F.log_softmax(model.compute_logits(hidden).double(), dim=-1).float()  # [n, vocab]
        if out is None:
            out = torch.empty(len(tokens) - 1, logprobs.shape[1])
        rows = min(len(piece), len(tokens) - 1 - start)
        out[start:start + rows] = logprobs[:rows]
    return out


def negative_log_likelihood(logprobs: torch.Tensor, tokens: list[int]) -> tuple[float, int]:
    """Sum of -log p(token i | tokens before it) over i >= 1, and the count."""
    targets = torch.tensor(tokens[1:len(logprobs) + 1])
    return -logprobs[torch.arange(len(targets)), targets].double().sum().item(), len(targets)


def log_softmax_rows(logits: torch.Tensor, rows: int = 128) -> torch.Tensor:
    """float32 [n, vocab] logits -> float32 log-probabilities, each row's computed in float64."""
    out = torch.empty(logits.shape, dtype=torch.float32)
    for i in range(0, len(logits), rows):
        out[i:i + rows] = F.log_softmax(logits[i:i + rows].double(), dim=-1).float()
    return out


def divergence(ref: torch.Tensor, other: torch.Tensor, tokens: list[int], rows: int = 128) -> dict:
    """Per position, KL(ref || other) = sum p_ref (log p_ref - log p_other) (float64 sums over float32
    log-probabilities [n, vocab]) and whether the top-1 tokens agree: their mean, the KL's 99th
    percentile and maximum, the share of positions with the reference's top-1; and the text's
    ln(perplexity ratio) other / ref (the mean over positions of ln p_ref - ln p_other of the next
    token) with its standard error (their standard deviation / sqrt(n)): how far a perplexity ratio
    may move on this text by chance alone."""
    kl, same = [], []
    for i in range(0, len(ref), rows):
        r, o = ref[i:i + rows].double(), other[i:i + rows].double()
        kl.append((r.exp() * (r - o)).sum(-1).clamp_min(0.0))
        same.append(ref[i:i + rows].argmax(-1) == other[i:i + rows].argmax(-1))
    k, t = torch.cat(kl), torch.cat(same)
    at, targets = torch.arange(len(ref)), torch.tensor(tokens[1:len(ref) + 1])
    gap = ref[at, targets].double() - other[at, targets].double()
    return dict(kld=k.mean().item(), kld_p99=torch.quantile(k, 0.99).item(), kld_max=k.max().item(),
                top1=t.double().mean().item(), positions=len(k), ln_ratio=gap.mean().item(),
                ln_ratio_se=(gap.std() / math.sqrt(len(gap))).item() if len(gap) > 1 else 0.0)


LLAMACPP_SCRIPT = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.stdin.read())
llm = Llama(model_path=a["gguf"], n_ctx=a["n_ctx"], n_batch=a["chunk"], logits_all=True, n_threads=a["threads"],
            verbose=False)
toks = a["tokens"]
llm.eval(toks)
np.save(a["logits"], np.asarray(llm.scores[:len(toks) - 1], dtype=np.float32))  # [positions, vocab]
answers = []
for prompt in a["prompts"]:
    out = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if len(out) == a["new_tokens"]:
            break
    answers.append(out)
print(json.dumps({"answers": answers}))
"""


def has_llama_cpp(python: str) -> bool:
    if not os.access(python, os.X_OK):
        return False
    return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=120).returncode == 0


def llamacpp_run(python: str, gguf: Path, tokens: list[int], chunk: int, threads: int, prompts: list[list[int]],
                 new_tokens: int) -> tuple[torch.Tensor, list[list[int]]]:
    """llama.cpp on the file: its log-probabilities at the text's positions (float32
    [len(tokens) - 1, vocab], as ``text_logprobs``), and its greedy answers."""
    with tempfile.TemporaryDirectory(prefix="accuracy-llamacpp-") as tmp:
        path = Path(tmp) / "logits.npy"
        body = json.dumps({"gguf": str(gguf), "tokens": tokens, "n_ctx": len(tokens) + 16, "chunk": chunk,
                           "threads": threads, "prompts": prompts, "new_tokens": new_tokens, "logits": str(path)})
        out = subprocess.run([python, "-c", LLAMACPP_SCRIPT], input=body, capture_output=True, text=True,
                             timeout=1800)
        if out.returncode:
            raise RuntimeError(f"llama.cpp's perplexity failed: {out.stderr.strip().splitlines()[-1:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        logits = torch.from_numpy(np.load(path))
    if logits.shape[0] != len(tokens) - 1:
        raise ValueError(f"llama.cpp gave logits for {logits.shape[0]} positions, not {len(tokens) - 1}")
    return log_softmax_rows(logits), result["answers"]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, int]:
    """Share of tokens before the first divergence, answers identical whole."""
    before = 0
    for a, b in zip(ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        before += n
    return before / sum(len(b) for b in ref), sum(a == b for a, b in zip(ours, ref))


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pool_line(spec, dtype: torch.dtype, kv_cache_dtypes: list[str], tokens: int = 65536, page: int = 16) -> str:
    """What a pool of ``tokens`` pages of the model's dtype takes, and how many tokens each KV cache
    dtype holds in those bytes: the pool allocated (and zeroed, so resident) and its resident
    growth measured."""
    shape = dict(num_layers=spec.num_layers, page_size=page, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                 dtype=dtype)
    budget = KVLayout(num_pages=tokens // page, **shape).page_nbytes * (tokens // page)
    parts = []
    for kv in ["auto", *kv_cache_dtypes]:
        layout = KVLayout(num_pages=budget // KVLayout(num_pages=1, kv_cache_dtype=kv, **shape).page_nbytes,
                          kv_cache_dtype=kv, **shape)
        before = resident_bytes()
        pool = KVPool(layout)
        grown = resident_bytes() - before
        parts.append(f"{kv}: {layout.total_tokens:,} tokens ({layout.total_tokens / tokens:.2f}x; page "
                     f"{layout.page_nbytes:,} B; resident +{grown / 2**20:,.0f} MiB)")
        del pool
    return f"pool of {budget / 2**20:,.0f} MiB ({tokens:,} tokens of {str(dtype).removeprefix('torch.')}): " + \
        "; ".join(parts)


def kv_cache_main(args, model_dir: str, prompts: list[list[int]], text_tokens: list[int]) -> int:
    """``--kv-cache-dtype``: the model served as it is (``--quantization auto``, ``--kv-dtype``) with
    pages of its dtype (the reference) and of each named dtype; the same figures and bounds."""
    rows, answers, ref_logprobs, failed = {}, {}, None, []
    for kv in ["auto", *args.kv_cache_dtype.split(",")]:
        t0 = time.perf_counter()
        engine = engine_for(model_dir, "auto", args, dtype=args.kv_dtype, kv_cache_dtype=kv)
        logprobs = text_logprobs(engine, text_tokens, args.chunk)
        nll, n = negative_log_likelihood(logprobs, text_tokens)
        answers[kv] = greedy(engine, prompts, args.new_tokens)
        ref_logprobs = logprobs if ref_logprobs is None else ref_logprobs
        spec = engine.spec
        rows[kv] = dict(ppl=math.exp(nll / n), tokens=n, page_nbytes=engine.layout.page_nbytes,
                        ops=engine.runner.model.ops.name,
                        seconds=time.perf_counter() - t0, **divergence(ref_logprobs, logprobs, text_tokens))
        del engine, logprobs
    print(f"KV cache: reference pages of the model's dtype ({args.kv_dtype}, --quantization auto); text "
          f"{TEXT.relative_to(Path(__file__).parent.parent)} ({len(text_tokens)} tokens, chunks of {args.chunk}); "
          f"{len(PROMPTS)} chat prompts x {args.new_tokens} greedy tokens; ops {rows['auto']['ops']}; threads "
          f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'--kv-cache-dtype':>16} {'page bytes':>10} {'perplexity':>10} {'/ reference':>11} {'greedy agree':>12} "
          f"{'whole answers':>13} {'KLD mean':>9} {'KLD p99':>8} {'same top-1':>10} {'ratio ± 1 SE':>12}")
    ref = rows["auto"]
    print(pool_line(spec, spec.dtype, args.kv_cache_dtype.split(",")))
    for kv, r in rows.items():
        share, whole = agreement(answers[kv], answers["auto"])
        r.update(agree=share, whole=whole, ratio=r["ppl"] / ref["ppl"])
        print(f"{kv:>16} {r['page_nbytes']:>10} {r['ppl']:>10.3f} {r['ratio']:>10.4f}x {share:>11.1%} "
              f"{whole:>6}/{len(PROMPTS)} {r['kld']:>15.5f} {r['kld_p99']:>8.4f} {r['top1']:>10.2%} "
              f"{'±':>5} {r['ratio'] * r['ln_ratio_se']:.4f}")
        if kv != "auto":
            failed += [f"{kv}: {what}" for what, bad in (
                (f"perplexity {r['ratio']:.4f}x the reference's > {PPL_BOUND}", r["ratio"] > PPL_BOUND),
                (f"mean KL divergence {r['kld']:.5f} > {KLD_BOUND}", r["kld"] > KLD_BOUND),
                (f"the same top-1 token at {r['top1']:.2%} < {TOP1_BOUND:.0%}", r["top1"] < TOP1_BOUND)) if bad]
    print(f"bounds: perplexity <= {PPL_BOUND}x the reference's, mean KLD <= {KLD_BOUND}, the same top-1 >= "
          f"{TOP1_BOUND:.0%}: " + ("; ".join(failed) if failed else "all hold"))
    if args.result_json:
        args.result_json.write_text(json.dumps(dict(rows=rows, failed=failed), indent=1))
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (the demo model) or a .gguf file")
    ap.add_argument("--modes", default="auto", help="comma-separated --quantization modes against none")
    ap.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per prompt")
    ap.add_argument("--chunk", type=int, default=512, help="prompt chunk (tokens) of the perplexity pass")
    ap.add_argument("--threads", type=int, default=None, help="torch threads and llama.cpp's (default: torch's)")
    ap.add_argument("--llamacpp-python", default=os.environ.get("SPLITSERVE_REF_LLAMACPP", DEFAULT_LLAMACPP),
                    help="the python of llama.cpp's venv (default: $SPLITSERVE_REF_LLAMACPP, else %(default)s)")
    ap.add_argument("--result-json", type=Path, default=None)
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="measure these KV cache dtypes (comma-separated, e.g. int8) against pages of the model's "
                         "dtype instead of the weights' modes")
    ap.add_argument("--kv-dtype", default="bfloat16", help="the model's dtype with --kv-cache-dtype (%(default)s)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    src = gguf_source(args.model)
    model_dir = resolve_model_dir(args.model)
    tok = load_tokenizer(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in PROMPTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    text_tokens = list(tok(TEXT.read_text())["input_ids"])
    if args.kv_cache_dtype:
        return kv_cache_main(args, model_dir, prompts, text_tokens)

    rows = {}
    answers = {}
    ref_logprobs: Optional[torch.Tensor] = None  # the reference's, float32 [positions, vocab]
    auto_logprobs: Optional[torch.Tensor] = None  # kept to set against llama.cpp's
    for mode in ["none", *args.modes.split(",")]:
        t0 = time.perf_counter()
        engine = engine_for(model_dir, mode, args)
        logprobs = text_logprobs(engine, text_tokens, args.chunk)
        nll, n = negative_log_likelihood(logprobs, text_tokens)
        answers[mode] = greedy(engine, prompts, args.new_tokens)
        rows[mode] = dict(quantization=engine.spec.quantization, ppl=math.exp(nll / n), tokens=n,
                          seconds=time.perf_counter() - t0)
        if ref_logprobs is None:
            ref_logprobs = logprobs
        rows[mode].update(divergence(ref_logprobs, logprobs, text_tokens))
        if mode == "auto":
            auto_logprobs = logprobs
        del engine, logprobs
    llamacpp: Optional[float] = None
    llamacpp_div: dict = {}
    auto_vs_llamacpp: dict = {}
    llamacpp_answers: list[list[int]] = []
    llamacpp_why = f"{args.llamacpp_python} cannot import llama_cpp: bash bench/refs/setup_llamacpp.sh"
    if has_llama_cpp(args.llamacpp_python):
        try:
            logprobs, llamacpp_answers = llamacpp_run(args.llamacpp_python, src, text_tokens, args.chunk,
                                                      torch.get_num_threads(), prompts, args.new_tokens)
            nll, n = negative_log_likelihood(logprobs, text_tokens)
            llamacpp = math.exp(nll / n)
            llamacpp_div = divergence(ref_logprobs, logprobs, text_tokens)
            if auto_logprobs is not None:
                auto_vs_llamacpp = divergence(logprobs, auto_logprobs, text_tokens)
            del logprobs
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            llamacpp_why = str(exc)
    ref = rows["none"]
    print(f"model {src.name} ({src.stat().st_size / 1e6:.0f} MB); reference: --quantization none (the file "
          f"dequantized to float32); text {TEXT.relative_to(Path(__file__).parent.parent)} ({len(text_tokens)} "
          f"tokens, chunks of {args.chunk}); {len(PROMPTS)} chat prompts x {args.new_tokens} greedy tokens; "
          f"threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'--quantization':>14} {'weights':>18} {'perplexity':>10} {'/ reference':>11} {'greedy agree':>12} "
          f"{'whole answers':>13} {'KLD mean':>9} {'KLD p99':>8} {'same top-1':>10} {'ratio ± 1 SE':>12}")
    failed = []
    for mode, r in rows.items():
        share, whole = agreement(answers[mode], answers["none"])
        r.update(agree=share, whole=whole, ratio=r["ppl"] / ref["ppl"])
        print(f"{mode:>14} {r['quantization']:>18} {r['ppl']:>10.3f} {r['ratio']:>10.4f}x {share:>11.1%} "
              f"{whole:>6}/{len(PROMPTS)} {r['kld']:>15.5f} {r['kld_p99']:>8.4f} {r['top1']:>10.2%} "
              f"{'±':>5} {r['ratio'] * r['ln_ratio_se']:.4f}")
        if mode != "none":
            if r["ratio"] > PPL_BOUND:
                failed.append(f"{mode}: perplexity {r['ratio']:.4f}x the reference's > {PPL_BOUND}")
            if r["kld"] > KLD_BOUND:
                failed.append(f"{mode}: mean KL divergence {r['kld']:.5f} > {KLD_BOUND}")
            if r["top1"] < TOP1_BOUND:
                failed.append(f"{mode}: the same top-1 token at {r['top1']:.2%} of the positions < {TOP1_BOUND:.0%}")
    if llamacpp is not None:
        ours = rows.get("auto", ref)["ppl"]
        share, whole = agreement(llamacpp_answers, answers["none"])
        ours_share = agreement(answers["auto"], llamacpp_answers)[0] if "auto" in answers else float("nan")
        print(f"llama.cpp (llama-cpp-python, the same file and tokens): perplexity {llamacpp:.3f} "
              f"({llamacpp / ref['ppl']:.4f}x the reference's); splitserve --quantization auto / llama.cpp "
              f"{ours / llamacpp:.4f}x; its greedy answers against the reference {share:.1%} ({whole}/{len(PROMPTS)} "
              f"whole), against splitserve's auto {ours_share:.1%}")
        print(f"llama.cpp against the reference, per position of the text: KLD mean {llamacpp_div['kld']:.5f}, "
              f"p99 {llamacpp_div['kld_p99']:.4f}, same top-1 {llamacpp_div['top1']:.2%}, perplexity ratio "
              f"{llamacpp / ref['ppl']:.4f}x ± {llamacpp / ref['ppl'] * llamacpp_div['ln_ratio_se']:.4f}"
              + (f"; splitserve's auto against llama.cpp: KLD mean {auto_vs_llamacpp['kld']:.5f}, same top-1 "
                 f"{auto_vs_llamacpp['top1']:.2%}, perplexity ratio {ours / llamacpp:.4f}x ± "
                 f"{ours / llamacpp * auto_vs_llamacpp['ln_ratio_se']:.4f}" if auto_vs_llamacpp else ""))
    else:
        print(f"llama.cpp: not measured ({llamacpp_why})")
    print(f"bounds: perplexity <= {PPL_BOUND}x the reference's, mean KLD <= {KLD_BOUND}, the same top-1 >= "
          f"{TOP1_BOUND:.0%}: "
          + ("; ".join(failed) if failed else "all hold"))
    if args.result_json:
        args.result_json.write_text(json.dumps(dict(rows=rows, llamacpp_ppl=llamacpp, llamacpp=llamacpp_div,
                                                    auto_vs_llamacpp=auto_vs_llamacpp, failed=failed), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
