"""A worker's resident memory on the demo model against what it must hold: the GGUF file's size
(its weights stay as the file's blocks, ``--quantization auto``) plus its KV pool, plus an overhead
this bench bounds (``OVERHEAD_BOUND``: torch and its libraries, the tokenizer and ``transformers``
behind it, the HTTP server, the compiled kernels, the activations of a step).

Each set-up is a real ``splitserve serve`` process (one at a time) on the demo model's GGUF file
(SmolLM2-135M-Instruct, Q4_1, 98 MB), sent ``--requests`` streaming completions of a 240-word
prompt first (so every path has run and the step's buffers exist); then its RSS and peak RSS
(VmHWM) are read. The pool's size is what the worker reports (``/get_server_info``: tokens and
dtype, which ``--dtype auto`` picks: bfloat16 where the CPU has native bf16, else float32), in
bytes: tokens x layers x 2 x KV heads x head dim x dtype size (an int8 cache: head dim + 4 for its
scale). Set-ups (``--setups``):

  default     serve --model smollm2 (the default pool: 65,536 tokens)
  small-pool  the same with --max-total-tokens 8192: the overhead should not follow the pool
  prefill     serve --role prefill (a pool of its own; no decode-side structures)
  int8-kv     --kv-cache-dtype int8 with 1.875x the default's tokens: its pool should take the
              default's bytes (a 64-byte row and its 4-byte scale against 128 bytes of bfloat16)

Prints one row per set-up and checks RSS <= GGUF + pool + OVERHEAD_BOUND for each (exit 1 when
one fails). Usage::

    .venv/bin/python bench/memory.py [--setups default,small-pool] [--requests 4] [--result-json m.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
from procs import free_port  # noqa: E402
from vs_refs import Server, memory_of, splitserve_argv  # noqa: E402

OVERHEAD_BOUND = 600e6  # bytes
SETUPS = {
    "default": [],
    "small-pool": ["--max-total-tokens", "8192"],
    "int8-kv": ["--kv-cache-dtype", "int8", "--max-total-tokens", "122880"],
    "prefill": ["--role", "prefill", "--bootstrap-port", "{bootstrap}", "--insecure-control-plane"],
}
PROMPT = " ".join(["the lighthouse keeper watched the sea through the long night"] * 24)  # 240 words


def pool_bytes(info: dict, config: dict) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    if info.get("kv_cache_dtype") == "int8":  # a row: head_dim bytes and its float32 scale
        row = head_dim + 4
    else:
        row = head_dim * {"float32": 4, "bfloat16": 2, "float16": 2}[info["dtype"]]
    return info["max_total_num_tokens"] * config["num_hidden_layers"] * 2 * kv_heads * row


def measure(name: str, extra: list[str], args, gguf: Path, config: dict, logs: Path) -> dict:
    port = free_port()
    extra = [a.replace("{bootstrap}", str(free_port())) for a in extra]
    server = Server(name, splitserve_argv("serve", "--model", "smollm2", "--host", "127.0.0.1", "--port", str(port),
                                          *extra), port, logs / f"{name}.log")
    server.start()
    try:
        model = server.wait_ready(args.ready_timeout)
        info = requests.get(server.url + "/get_server_info", timeout=10).json()
        if "--role" not in extra:
            for _ in range(args.requests):
                r = requests.post(server.url + "/v1/completions", timeout=600, json={
                    "model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": False})
                r.raise_for_status()
        worker = max(memory_of(server.proc.pid), key=lambda row: row["rss"])
    finally:
        server.stop()
    pool = pool_bytes(info, config)
    size = gguf.stat().st_size
    return dict(setup=name, dtype=info["dtype"], pool_tokens=info["max_total_num_tokens"], pool=pool, gguf=size,
                rss=worker["rss"], hwm=worker["hwm"], overhead=worker["rss"] - size - pool,
                ok=worker["rss"] <= size + pool + OVERHEAD_BOUND)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="default,small-pool", help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--requests", type=int, default=4, help="completions sent before RSS is read")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--result-json", type=Path, default=None)
    args = ap.parse_args()

    from splitserve.models.resolve import resolve_model_dir, smollm2_gguf

    gguf = smollm2_gguf()
    config = json.loads((Path(resolve_model_dir("smollm2")) / "config.json").read_text())  # converts once
    rows = []
    with tempfile.TemporaryDirectory(prefix="splitserve-memory-") as logs:
        for name in args.setups.split(","):
            rows.append(measure(name, SETUPS[name], args, gguf, config, Path(logs)))
    mb = 1e6
    print(f"model {gguf.name} ({gguf.stat().st_size / mb:.0f} MB); overhead bound {OVERHEAD_BOUND / mb:.0f} MB; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'set-up':>10} {'dtype':>9} {'pool tokens':>11} {'pool MB':>8} {'RSS MB':>7} {'peak MB':>8} "
          f"{'GGUF + pool + overhead':>24} {'holds':>5}")
    for r in rows:
        parts = f"{r['gguf'] / mb:.0f} + {r['pool'] / mb:.0f} + {r['overhead'] / mb:.0f}"
        print(f"{r['setup']:>10} {r['dtype']:>9} {r['pool_tokens']:>11} {r['pool'] / mb:>8.0f} {r['rss'] / mb:>7.0f} "
              f"{r['hwm'] / mb:>8.0f} {parts:>24} {'yes' if r['ok'] else 'NO':>5}")
    if args.result_json:
        args.result_json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
