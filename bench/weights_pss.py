"""Memory per host of the weights: the PSS of the weight mappings of ``splitserve launch`` with one
prefill and one decode worker, against one worker's weights.

Each worker maps the host's one file of packed weights (``splitserve/models/packed_file.py``), so
the two workers' PSS of that mapping (``/proc/PID/smaps``: each page counted once per host, split
between the processes mapping it) should add up to one copy; the target is at most
``TARGET`` x one worker's weights (the file's tensor bytes). ``--setups shared,private`` also runs
the same launch with ``SPLITSERVE_SHARED_WEIGHTS=0`` (each worker its own copy) and prints both
workers' whole PSS, so the copy saved shows. Before reading, one completion runs through the pair
(``--requests``; the router splits every prompt: ``--pd-threshold-tokens 0``), so both workers have
read every weight. Run it once the GGUF file is converted (a first ``serve`` of it): the worker that
converts it keeps the converter's memory, which its whole PSS would show.

The model: a GGUF file, e.g. the 1B shape made by
``splitserve make-model llama-3.2-1b /tmp/m1b --gguf Q4_0 --no-hf``. Usage::

    .venv/bin/python bench/weights_pss.py --model /tmp/m1b/llama-3.2-1b-q4_0.gguf [--setups shared,private]
        [--max-total-tokens 8192] [--result-json w.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).parent))
from procs import free_port  # noqa: E402
from vs_refs import Server, splitserve_argv  # noqa: E402

TARGET = 1.2
SETUPS = {"shared": {}, "private": {"SPLITSERVE_SHARED_WEIGHTS": "0"}}
PROMPT = " ".join(["the lighthouse keeper watched the sea through the long night"] * 8)


def weight_mappings(pid: int, folder: Path) -> dict:
    """RSS and PSS in bytes of ``pid``'s mappings of files in ``folder``, its whole PSS, and the file."""
    rss = pss = 0
    inside, files = False, set()
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[5].startswith(str(folder) + "/")
            if inside:
                files.add(fields[5])
        elif inside and fields[0] in ("Rss:", "Pss:"):
            value = int(fields[1]) * 1024
            rss, pss = (rss + value, pss) if fields[0] == "Rss:" else (rss, pss + value)
    total = psutil.Process(pid).memory_full_info().pss
    return dict(pid=pid, rss=rss, pss=pss, total_pss=total, files=sorted(files))


def workers(root: int) -> dict[str, int]:
    """The launch's worker processes by role (prefill, decode)."""
    found = {}
    for p in psutil.Process(root).children(recursive=True):
        cmd = p.cmdline()
        if "--role" in cmd:
            found[cmd[cmd.index("--role") + 1]] = p.pid
    return found


def measure(name: str, args, logs: Path, packed: Path) -> dict:
    port = free_port()
    argv = splitserve_argv("launch", "--model", str(args.model), "--num-prefill", "1", "--num-decode", "1",
                           "--port", str(port), "--worker-args", f"--max-total-tokens {args.max_total_tokens}",
                           "--router-args", "--pd-threshold-tokens 0")  # every prompt through the prefill
    server = Server(name, argv, port, logs / f"{name}.log", env=SETUPS[name])
    server.start()
    try:
        model = server.wait_ready(args.ready_timeout)
        for _ in range(args.requests):
            requests.post(server.url + "/v1/completions", timeout=900, json={
                "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).raise_for_status()
        rows = {role: weight_mappings(pid, packed) for role, pid in sorted(workers(server.proc.pid).items())}
    finally:
        server.stop()
    return dict(setup=name, workers=rows)


def one_copy(rows: dict) -> int:
    """One worker's weights: the tensor bytes of the file the workers map (size less the header)."""
    from splitserve.models.packed_file import read_header

    files = {f for r in rows.values() for f in r["files"]}
    if len(files) != 1:
        return 0
    path = Path(files.pop())
    header = read_header(path)
    return sum(row["nbytes"] for row in header["table"]) if header else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a .gguf file (or anything --model takes)")
    ap.add_argument("--setups", default="shared", help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="each worker's KV pool, in tokens")
    ap.add_argument("--requests", type=int, default=1, help="completions run before memory is read")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--result-json", type=Path, default=None)
    args = ap.parse_args()

    from splitserve.models.cache import cache_root

    packed = cache_root() / "packed"
    results, ok = [], True
    with tempfile.TemporaryDirectory(prefix="splitserve-weights-pss-") as logs:
        for name in args.setups.split(","):
            results.append(measure(name, args, Path(logs), packed))
    mb = 1e6
    print(f"model {args.model.name}; --max-total-tokens {args.max_total_tokens}; load average "
          f"{os.getloadavg()[0]:.1f}")
    for r in results:
        rows, weights = r["workers"], one_copy(r["workers"])
        pss = sum(w["pss"] for w in rows.values())
        parts = " + ".join(f"{role} {w['pss'] / mb:.0f} (RSS {w['rss'] / mb:.0f})" for role, w in rows.items())
        whole = " + ".join(f"{role} {w['total_pss'] / mb:.0f}" for role, w in rows.items())
        line = f"{r['setup']:>8}: weight mappings PSS {parts} = {pss / mb:.0f} MB"
        if weights:
            ratio = pss / weights
            ok = ok and (r["setup"] != "shared" or ratio <= TARGET)
            line += f" against one worker's weights {weights / mb:.0f} MB: {ratio:.2f}x (target <= {TARGET}x)"
        elif r["setup"] == "shared":
            ok = False
            line += " (no single weights file mapped)"
        print(line + f"; whole PSS {whole} MB")
        r["one_copy"] = weights
    if args.result_json:
        args.result_json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
