"""Run seeds of the cluster simulator: 2 prefill + 2 decode workers and a router, the project's own
code in one process on a virtual clock, clients and faults drawn from the seed, every invariant
checked while it runs (docs/lifecycle.md, "The simulator").

``--seed N`` runs one seed and prints its report (a failing one: the violation, the trace of the
events before it, and the command that replays it); ``--seeds N`` runs seeds ``--first`` ..
``--first + N - 1`` and prints a line per failing seed and the totals; ``--minutes M`` runs seeds
from ``--first`` on until M minutes of wall time have passed. Two runs of one seed print the same
in any process, apart from the lines that start with ``wall``. The exit status is 1 if any seed
broke an invariant.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from splitserve.sim.run import run_many, run_seed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve.sim", description=__doc__.split("\n\n")[0],
                                     epilog="A failing seed replays exactly: python -m splitserve.sim --seed N "
                                            "(with the same --requests).")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--seed", type=int, help="run this one seed and print its report")
    what.add_argument("--seeds", type=int, help="run this many seeds, from --first on")
    what.add_argument("--minutes", type=float, help="run seeds from --first on for this many minutes of wall time")
    parser.add_argument("--first", type=int, default=0, help="the first seed of --seeds / --minutes (default 0)")
    parser.add_argument("--requests", type=int, default=300, help="client requests per seed (default 300)")
    parser.add_argument("--trace", type=int, default=80, help="events of the trace a failing seed prints (default 80)")
    parser.add_argument("--kv-failure-policy", choices=("fail", "recompute"), default="fail",
                        help="decode's --kv-failure-policy (default fail; a seed is otherwise the same)")
    parser.add_argument("--processes", type=int, default=1,
                        help="run --seeds in this many processes (default 1; the totals are the same)")
    args = parser.parse_args(argv)
    if args.seed is not None:
        result = run_seed(args.seed, requests=args.requests, trace_size=args.trace,
                          kv_failure_policy=args.kv_failure_policy)
        print("\n".join(result.report()))
        return 0 if result.ok else 1
    started = time.perf_counter()

    def failing(result) -> None:
        if not result.ok:
            print(f"seed {result.seed}: {result.violations[0]}  (replay: python -m splitserve.sim --seed "
                  f"{result.seed}{'' if args.requests == 300 else f' --requests {args.requests}'}"
                  f"{'' if args.kv_failure_policy == 'fail' else ' --kv-failure-policy ' + args.kv_failure_policy})",
                  flush=True)

    if args.minutes is not None:  # seeds until the time is up
        totals = run_many(itertools.count(args.first), args.requests, args.processes, failing,
                          until=started + args.minutes * 60, kv_failure_policy=args.kv_failure_policy)
    else:
        count = args.seeds if args.seeds is not None else 100
        totals = run_many(range(args.first, args.first + count), args.requests, args.processes, failing,
                          kv_failure_policy=args.kv_failure_policy)
    print("\n".join(totals.report(time.perf_counter() - started)))
    return 0 if not totals.failed else 1


if __name__ == "__main__":
    sys.exit(main())
