"""How long one engine step of a long prompt takes, and its slowest decoder layer: the numbers
behind ``--max-batch-tokens``' default and ``--loop-stall-s``.

The engine-loop watchdog (``--loop-stall-s``, default 30 s) bounds the time between two marks of
progress, and a forward pass marks progress after every decoder layer; so what must stay well
under the bound is the slowest *layer* of the largest step, not the step. ``--max-batch-tokens``
(the tokens of one step) also sets how long decode requests colocated with a prompt wait for
their next token. This prints, for each step size, the step's seconds, its slowest layer's, and
both against the bound, with the CPU flags and the load average it ran under (a busy machine is
the case that matters: run it beside other work too). Usage::

    .venv/bin/python bench/step.py [--model smollm2] [--sizes 256,512,1024,2048,4096] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from splitserve.config import EngineConfig, ServerConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import GenerateRequest, SamplingParams


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return " ".join(sorted(x for x in set(flags) if x in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")))


class LayerClock:
    """The ``progress`` callback: the longest gap between two calls (a layer) since ``reset``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.last, self.longest = time.perf_counter(), 0.0

    def __call__(self) -> None:
        now = time.perf_counter()
        self.longest, self.last = max(self.longest, now - self.last), now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sizes", default="256,512,1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    bound = ServerConfig.loop_stall_s
    clock = LayerClock()
    engine = LLMEngine(EngineConfig(model=args.model, max_batch_tokens=max(sizes), max_total_tokens=2 * max(sizes)),
                       progress=clock)
    rng = random.Random(0)
    print(f"model {args.model}, dtype {engine.spec.dtype}, CPU flags: {cpu_flags()}, "
          f"load average {os.getloadavg()[0]:.1f}, torch threads {__import__('torch').get_num_threads()}")
    print(f"{'tokens':>7} {'step s':>8} {'slowest layer s':>16} {'step/bound':>11} {'layer/bound':>12}")
    for n in sizes:
        best_step, best_layer = float("inf"), float("inf")
        for i in range(args.repeat):
            ids = tuple(rng.randrange(100, engine.spec.vocab_size) for _ in range(n))
            engine.add_request(GenerateRequest(f"s{n}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=1)))
            clock.reset()
            t0 = time.perf_counter()
            engine.step()  # the whole prompt in one step: max_batch_tokens >= n
            best_step, best_layer = min(best_step, time.perf_counter() - t0), min(best_layer, clock.longest)
            while engine.has_work():
                engine.step()
            engine.flush_cache()
        print(f"{n:>7} {best_step:>8.2f} {best_layer:>16.3f} {best_step / bound:>11.3f} {best_layer / bound:>12.4f}")


if __name__ == "__main__":
    main()
