"""Offline generation: splitserve's engine against `transformers`' `generate`, in one run.

Same checkpoint, same dtype, same random prompts, greedy, no HTTP. For every dtype and batch size
asked for it prints tokens/s of each, the ratio, and the fraction of this machine's memory-bandwidth
roofline the engine reached: the bytes of the weights it reads x decode steps/s / a read bandwidth
measured in the same run (a sum over a buffer far larger than the caches). One stream cannot beat
that roofline by much: every step reads every weight once (unless part of them stays in the
last-level cache). Per dtype it also times one prompt of ``--prefill-len`` tokens (a forward pass
and its first token: prefill speed, where the matmuls run on many rows at once).

``--quantization`` is splitserve's (default ``auto``: a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K weights
stay as they are, so on the demo model splitserve reads 97 MB a step where `transformers` reads
the float weights: the ratio then includes quantization's gain); ``none`` compares like with like.
`transformers` loads a GGUF model through its own GGUF loader (dequantized). Usage::

    .venv/bin/python bench/engine.py [--model smollm2|tiny|PATH] [--dtype bfloat16,float32] [--batch 1,16]
                                     [--quantization auto|none|int8|int4] [--prompt-len 64]
                                     [--new-tokens 128] [--prefill-len 512] [--repeat 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Optional

import torch

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import GenerateRequest, SamplingParams
from splitserve.models.resolve import resolve_model_dir


class Bandwidth:
    """Read bandwidth: bytes/s of one ``torch.sum`` over 2 GiB of float32 (4x the largest cache
    here), the best of every ``measure()`` call: the runs call it between timings, so a load
    from other processes that slows a timing is not mistaken for the machine's speed."""

    def __init__(self, nbytes: int = 2 << 30):
        self.buf = torch.ones(nbytes // 4, dtype=torch.float32)
        self.best = 0.0

    def measure(self, repeat: int = 3) -> float:
        for _ in range(repeat):
            t0 = time.perf_counter()
            self.buf.sum()
            self.best = max(self.best, self.buf.numel() * 4 / (time.perf_counter() - t0))
        return self.best


def best_times(fns: dict, repeat: int, between=lambda: None) -> dict:
    """name -> (seconds of its fastest timed call, that call's result). One warm-up call each,
    then ``repeat`` rounds calling each in turn, so load from other processes hits all alike."""
    for fn in fns.values():
        fn()
    best = {name: (float("inf"), None) for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            between()
            t0 = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - t0
            if elapsed < best[name][0]:
                best[name] = (elapsed, result)
    return best


def gguf_source(model: str) -> Optional[Path]:
    """The GGUF file behind ``--model``, None for a checkpoint folder."""
    from splitserve.models.gguf import find_gguf
    from splitserve.models.resolve import BUILTIN_MODELS, smollm2_gguf

    if model == "smollm2":
        return smollm2_gguf()
    return None if model in BUILTIN_MODELS else find_gguf(model)


def weight_bytes_read(model: torch.nn.Module) -> int:
    """What one decode step reads: every weight once, as the engine holds it (quantized blocks,
    packed copies; a tied embedding once, as the head)."""
    from splitserve.layers.linear import Linear

    total = 0
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None:
            total += quant.nbytes
        for name in ("f32_packed", "packed"):
            t = getattr(module, name, None) if isinstance(module, Linear) else None
            if t is not None:
                total += t.numel() * t.element_size()
        for p in module.parameters(recurse=False):
            total += p.numel() * p.element_size()
    return total


def bench_dtype(args, dtype: str, batches: list[int], bandwidth: Bandwidth) -> list[dict]:
    model_dir, src = resolve_model_dir(args.model), gguf_source(args.model)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, quantization=args.quantization,
                                    max_running_requests=max(batches),
                                    max_batch_tokens=max(2048, max(batches) * args.prompt_len, args.prefill_len)))
    torch_dtype = engine.spec.dtype
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if src is not None:
        hf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch_dtype).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    weight_bytes = weight_bytes_read(engine.runner.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    if args.prefill_len:
        prompt = torch.randint(10, engine.spec.vocab_size, (1, args.prefill_len), generator=g)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def prefill_ours() -> None:
            engine.generate([GenerateRequest("p", tuple(prompt[0].tolist()), one)])

        def prefill_hf() -> None:
            with torch.inference_mode():
                hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=1)

        timed = best_times({"ours": prefill_ours, "hf": prefill_hf}, args.repeat, bandwidth.measure)
        rows.append(dict(dtype=str(torch_dtype).removeprefix("torch."), batch=f"p{args.prefill_len}",
                         ours=args.prefill_len / timed["ours"][0], hf=args.prefill_len / timed["hf"][0],
                         steps=None, weight_bytes=weight_bytes, same=None))
    for batch in batches:
        prompts = torch.randint(10, engine.spec.vocab_size, (batch, args.prompt_len), generator=g)

        def run_ours() -> list[list[int]]:
            reqs = [GenerateRequest(f"b{i}", tuple(p.tolist()), params) for i, p in enumerate(prompts)]
            outs = engine.generate(reqs)
            return [list(outs[r.rid].token_ids) for r in reqs]

        def run_hf() -> list[list[int]]:
            with torch.inference_mode():
                out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                  max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
            return out[:, args.prompt_len:].tolist()

        timed = best_times({"ours": run_ours, "hf": run_hf}, args.repeat, bandwidth.measure)
        (ours_s, ours_tokens), (hf_s, hf_tokens) = timed["ours"], timed["hf"]
        rows.append(dict(dtype=str(torch_dtype).removeprefix("torch."), batch=batch,
                         ours=batch * args.new_tokens / ours_s, hf=batch * args.new_tokens / hf_s,
                         steps=args.new_tokens / ours_s, weight_bytes=weight_bytes,
                         same=sum(a == b for a, b in zip(ours_tokens, hf_tokens))))
    del engine
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (the demo model), tiny, a .gguf file or a checkpoint folder")
    ap.add_argument("--dtype", default="bfloat16,float32", help="comma-separated dtypes, one row each")
    ap.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512,
                    help="tokens of the one prompt timed alone (prefill tokens/s); 0: none")
    ap.add_argument("--quantization", default="auto", help="splitserve's --quantization (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed runs of each after a warm-up, in turns (the fastest is kept)")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    bandwidth = Bandwidth()
    rows = [row for dtype in args.dtype.split(",") for row in bench_dtype(args, dtype, batches, bandwidth)]
    bandwidth = bandwidth.measure()

    print(f"model {args.model} ({model_dir})  --quantization {args.quantization}  prompt {args.prompt_len}  "
          f"new tokens {args.new_tokens}  greedy  threads {torch.get_num_threads()}  "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s (torch.sum over 2 GiB, best of the run)  "
          f"load average {os.getloadavg()[0]:.1f}")
    print("batch pN: one prompt of N tokens, prefill tokens/s (its forward pass and first token)")
    print(f"{'dtype':>9} {'batch':>5} {'splitserve tok/s':>17} {'transformers tok/s':>19} {'ratio':>6} "
          f"{'weights MB':>10} {'roofline':>8} {'same greedy':>11}")
    for r in rows:
        roofline = f"{r['weight_bytes'] * r['steps'] / bandwidth:>8.2f}" if r["steps"] else f"{'':>8}"
        same = f"{r['same']:>5}/{r['batch']}" if r["same"] is not None else ""
        print(f"{r['dtype']:>9} {r['batch']:>5} {r['ours']:>17.1f} {r['hf']:>19.1f} {r['ours'] / r['hf']:>5.2f}x "
              f"{r['weight_bytes'] / 1e6:>10.0f} {roofline} {same}")


if __name__ == "__main__":
    main()
