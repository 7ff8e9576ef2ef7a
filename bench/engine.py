"""Offline batch generation: splitserve's engine against `transformers`' `generate`, in one run.

Same model, same prompts, greedy, batch 16, 128 new tokens each (by default). Prints tokens/s of
each and the ratio. Usage::

    .venv/bin/python bench/engine.py [--model tiny|DIR] [--batch 16] [--new-tokens 128] [--prompt-len 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import GenerateRequest, SamplingParams
from splitserve.models.resolve import resolve_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2, help="timed runs of each (the best is kept)")
    args = ap.parse_args()

    model_dir = resolve_model_dir(args.model)
    engine = LLMEngine(EngineConfig(model=model_dir, max_running_requests=args.batch,
                                    max_batch_tokens=max(2048, args.batch * args.prompt_len)))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, engine.spec.vocab_size, (args.batch, args.prompt_len), generator=g)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def run_ours() -> list[list[int]]:
        reqs = [GenerateRequest(f"b{i}", tuple(p.tolist()), params) for i, p in enumerate(prompts)]
        outs = engine.generate(reqs)
        return [list(outs[r.rid].token_ids) for r in reqs]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run_hf() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        return out[:, args.prompt_len:].tolist()

    total = args.batch * args.new_tokens
    results = {}
    for name, fn in (("splitserve", run_ours), ("transformers", run_hf)):
        fn()  # warm-up
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            tokens = fn()
            best = min(best, time.perf_counter() - t0)
        results[name] = (total / best, tokens)
    same = sum(a == b for a, b in zip(results["splitserve"][1], results["transformers"][1]))
    print(f"model {model_dir}  batch {args.batch}  prompt {args.prompt_len}  new tokens {args.new_tokens}  "
          f"threads {torch.get_num_threads()}")
    for name, (tps, _) in results.items():
        print(f"{name:>13}: {tps:8.1f} tokens/s")
    print(f"ratio splitserve / transformers: {results['splitserve'][0] / results['transformers'][0]:.2f}x  "
          f"(identical greedy outputs: {same}/{args.batch})")


if __name__ == "__main__":
    main()
