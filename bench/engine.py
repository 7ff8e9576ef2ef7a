"""Offline generation: splitserve's engine against `transformers`' `generate`, in one run.

Same checkpoint, same dtype, same random prompts, greedy, no HTTP. For every dtype and batch size
asked for it prints tokens/s of each, the ratio, and the fraction of this machine's memory-bandwidth
roofline the engine reached: weight bytes x decode steps/s / a read bandwidth measured in the same
run (a sum over a buffer far larger than the caches). One stream cannot beat that roofline by much:
every step reads every weight once (unless part of them stays in the last-level cache). Usage::

    .venv/bin/python bench/engine.py [--model smollm2|tiny|PATH] [--dtype bfloat16,float32] [--batch 1,16]
                                     [--prompt-len 64] [--new-tokens 128] [--repeat 3] [--threads N]
"""

from __future__ import annotations

import argparse
import time

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


def bench_dtype(model_dir: str, dtype: str, batches: list[int], args, bandwidth: Bandwidth) -> list[dict]:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_running_requests=max(batches),
                                    max_batch_tokens=max(2048, max(batches) * args.prompt_len)))
    torch_dtype = engine.spec.dtype
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    # what one decode step reads: every weight once (a tied embedding counted once, as the head)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rows = []
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
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (the demo model), tiny, a .gguf file or a checkpoint folder")
    ap.add_argument("--dtype", default="bfloat16,float32", help="comma-separated dtypes, one row each")
    ap.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed runs of each after a warm-up, in turns (the fastest is kept)")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    bandwidth = Bandwidth()
    rows = [row for dtype in args.dtype.split(",")
            for row in bench_dtype(model_dir, dtype, batches, args, bandwidth)]
    bandwidth = bandwidth.measure()

    print(f"model {args.model} ({model_dir})  prompt {args.prompt_len}  new tokens {args.new_tokens}  greedy  "
          f"threads {torch.get_num_threads()}  read bandwidth {bandwidth / 1e9:.1f} GB/s "
          "(torch.sum over 2 GiB, best of the run)")
    print(f"{'dtype':>9} {'batch':>5} {'splitserve tok/s':>17} {'transformers tok/s':>19} {'ratio':>6} "
          f"{'weights MB':>10} {'roofline':>8} {'same greedy':>11}")
    for r in rows:
        roofline = r["weight_bytes"] * r["steps"] / bandwidth
        print(f"{r['dtype']:>9} {r['batch']:>5} {r['ours']:>17.1f} {r['hf']:>19.1f} {r['ours'] / r['hf']:>5.2f}x "
              f"{r['weight_bytes'] / 1e6:>10.0f} {roofline:>8.2f} {r['same']:>5}/{r['batch']}")


if __name__ == "__main__":
    main()
