"""Read a Hugging Face checkpoint directory into a splitserve model and its ``ModelSpec``.

A directory holds ``config.json``, the weights as ``model.safetensors`` or as shards listed by
``model.safetensors.index.json``, optionally ``generation_config.json`` (EOS ids, default sampling
values) and the tokenizer files (``load_tokenizer``). Nothing is fetched from a hub. A GGUF file
reaches this loader as such a directory, converted once by ``gguf.py``; ``resolve.py`` turns
``--model`` into the directory.

The model is built on the meta device (no memory, no random init), cast, materialised on the
target device and filled from the safetensors files; a tensor the model needs but the checkpoint
lacks is an error naming it, so no parameter is ever left uninitialised.

The model carries ``weights_identity`` (``checkpoint_identity``): what its weights' bytes follow
from, the key by which a host's workers share one file of them (``packed_file.py``). Where that
file exists and holds every weight the model needs as it is made (the quantized blocks already
packed, the plain parameters), the model maps it and reads nothing of the checkpoint's weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import torch
from torch import nn

from splitserve.models import get_model_class, packed_file, quantized, supported_architectures

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

log = logging.getLogger(__name__)
_KERNELS = object()  # load_model's default: load the compiled kernels


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the server needs to know about a loaded model (the KV pool layout, the
    compatibility check between peers, EOS handling and sampling defaults)."""

    name: str  # the checkpoint folder's basename
    path: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int  # max_position_embeddings
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]  # generation_config.json's first, then config.json's
    generation_defaults: dict  # temperature / top_p / top_k, those generation_config.json sets
    tie_word_embeddings: bool
    quantization: str = "none"  # the weights' types: "none" or e.g. "Q4_1:210,Q8_0:1" (quantized.Plan.summary)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                   "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")
_init_lock = threading.Lock()


@contextlib.contextmanager
def _without_random_init():
    """``torch.nn.init`` does nothing while the model's modules are made: their parameters are
    made on the meta device and get their values from the checkpoint. (On meta tensors the random
    init goes through ``torch._refs``, whose first call imports ``torch._dynamo``, for values
    nobody reads: a tiny worker was ready in 2.73 s instead of 2.95 s without it.) Process-wide
    while it lasts, as ``transformers``' ``no_init_weights`` is; the lock keeps two loads from
    restoring each other's no-ops."""
    with _init_lock:
        saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, function in saved.items():
                setattr(nn.init, name, function)


def load_model(model_dir: Union[str, os.PathLike], dtype: Union[str, torch.dtype] = "auto",
               device: Union[str, torch.device] = "cpu", quantization: str = "auto",
               kernels=_KERNELS, cpu_flags: Optional[Iterable[str]] = None) -> tuple[nn.Module, ModelSpec]:
    """Load the checkpoint in ``model_dir``. ``dtype``: auto (``resolve_dtype``), float32,
    bfloat16 or float16. ``quantization``: auto, none, int8 or int4 (``models/quantized.py``);
    ``kernels``: the compiled kernels' namespace, None for none (default: ``kernels.load()`` on CPU);
    ``cpu_flags``: the CPU's instruction-set flags ``--dtype`` decides by (default: this CPU's)."""
    path = Path(model_dir).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    config = read_config(path)
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{path / 'config.json'} names no 'architectures'; supported: "
                         f"{', '.join(supported_architectures())}")
    model_cls = get_model_class(architectures[0])
    files = safetensors_files(path)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device, config, path, cpu_flags)

    if kernels is _KERNELS:
        from splitserve.layers import kernels as compiled

        kernels = compiled.load() if device.type == "cpu" else None
    stored = quantized.read_manifest(path)
    with _without_random_init(), torch.device("meta"):
        model = model_cls(config)
        plan = quantized.make_plan(model.quantizable(), stored, quantization, kernels)
        model.expect_quantized(plan.layers)
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    identity = checkpoint_identity(path, files, plan.summary(), torch_dtype, device, kernels is not None)
    if packed_file.attach_file(model, identity, kernels) is None:  # no host's copy to map: load our own
        model.load_weights(quantized.prepared(iter_weights(files), stored, plan, torch_dtype))
        if plan.layers:
            model.finish_quantized(kernels)
    model.eval().requires_grad_(False)
    model.weights_identity = identity
    log.info("--quantization %s: %s", quantization, plan.summary())

    generation = read_generation_config(path)
    args = model.args
    spec = ModelSpec(
        name=path.name,
        path=str(path),
        architecture=architectures[0],
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        max_context=args.max_context,
        dtype=torch_dtype,
        eos_token_ids=_eos_ids(generation.get("eos_token_id"), config.get("eos_token_id")),
        generation_defaults={k: generation[k] for k in GENERATION_DEFAULT_KEYS if generation.get(k) is not None},
        tie_word_embeddings=args.tie_word_embeddings,
        quantization=plan.summary(),
    )
    return model, spec


def load_tokenizer(model_dir: Union[str, os.PathLike]):
    """The checkpoint's tokenizer via ``transformers.AutoTokenizer`` (local files only)."""
    path = Path(model_dir).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files in {str(path)!r} (looked for {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {e}") from e


# -- pieces ----------------------------------------------------------------------------------------


def checkpoint_identity(path: Path, files: list[Path], plan: str, dtype: torch.dtype, device: torch.device,
                        kernels: bool) -> dict:
    """What a loaded model's weight bytes follow from: the folder, its config and quantization
    manifest (hashed), each weight file's name, size and mtime, the quantization plan, dtype, device
    and whether the compiled kernels run it (they repack float32 weights)."""
    def digest(name: str) -> str:
        file = path / name
        return hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else ""

    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return {"name": path.name, "path": str(path), "config": digest("config.json"),
            "manifest": digest(quantized.MANIFEST), "files": stats, "plan": plan,
            "dtype": str(dtype), "device": str(device), "kernels": kernels}


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json; is it a Hugging Face checkpoint directory?")
    with open(config_file) as f:
        return json.load(f)


def read_generation_config(path: Path) -> dict:
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return {}
    with open(gen_file) as f:
        return json.load(f)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: the shards named by the index, else model.safetensors, else any *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} in {str(path)!r} names missing shard(s): {', '.join(missing)}")
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        gguf = [p.name for p in path.iterdir() if p.suffix == ".gguf"]
        hint = (f" (found {', '.join(sorted(other))}: only safetensors and GGUF weights are supported)" if other
                else f" (found {', '.join(sorted(gguf))}: pass the .gguf file itself as --model)" if gguf else "")
        raise FileNotFoundError(f"no *.safetensors weight files in {str(path)!r}{hint}")
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every file, one at a time (memory-mapped)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # CPU flags under which bfloat16 matmuls run natively


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_dtype(flags: Iterable[str]) -> tuple[torch.dtype, str]:
    """What ``--dtype auto`` computes in on a CPU with ``flags``, and why. bfloat16 where the CPU
    runs it natively (AVX512-BF16 or AMX-BF16: oneDNN's bf16 matmuls there are ~1.5-20x float32's
    speed, most on prompt chunks, and the KV pool takes half the memory); float32 elsewhere, where
    bf16 is emulated (measured on an AVX2 CPU: 0.38x float32 at batch 16)."""
    native = [f for f in NATIVE_BF16 if f in set(flags)]
    if native:
        return torch.bfloat16, f"the CPU has native bf16 ({', '.join(native)})"
    return torch.float32, "the CPU has no native bf16 (AVX512-BF16, AMX-BF16): bf16 would be emulated"


def slower_than_float32(dtype: torch.dtype, flags: Iterable[str]) -> Optional[str]:
    """Why an explicit CPU ``dtype`` runs slower than float32 on a CPU with ``flags``, else None."""
    if dtype == torch.bfloat16 and not set(NATIVE_BF16) & set(flags):
        return "this CPU has no native bf16 (AVX512-BF16, AMX-BF16): its bf16 matmuls are emulated"
    if dtype == torch.float16:
        return "the compiled CPU kernels run float32 and bfloat16 only: float16 runs the PyTorch ops"
    return None


def is_test_model(path: Optional[Path]) -> bool:
    """The built-in tiny models, recognised by the report their builder writes."""
    from splitserve.models.resolve import TEST_MODEL_REPORT

    return path is not None and (path / TEST_MODEL_REPORT).is_file()


def resolve_dtype(dtype: Union[str, torch.dtype], device: torch.device, config: dict,
                  path: Optional[Path] = None, flags: Optional[Iterable[str]] = None) -> torch.dtype:
    """The compute dtype. ``auto`` on CPU: float32 for the tiny test models (the exact-match tests
    against transformers need float32's margins), otherwise ``cpu_dtype``; on a GPU the
    checkpoint's own dtype. The choice is logged; an explicit CPU dtype slower than float32 there
    (``slower_than_float32``) is logged as a warning. ``flags``: the CPU's (default: this one's)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; supported: auto, {', '.join(DTYPES)}")
        picked = dtype
    elif dtype == "auto":
        if device.type != "cpu":
            saved = config.get("dtype") or config.get("torch_dtype")  # transformers 5 / 4 spelling
            picked, why = DTYPES.get(saved, torch.float32), f"the checkpoint's dtype on {device.type}"
        elif is_test_model(path):
            picked, why = torch.float32, "a tiny test model"
        else:
            picked, why = cpu_dtype(cpu_flags() if flags is None else flags)
        log.info("--dtype auto: %s (%s)", str(picked).removeprefix("torch."), why)
        return picked
    elif dtype in DTYPES:
        picked = DTYPES[dtype]
    else:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(DTYPES)}")
    if device.type == "cpu":
        slower = slower_than_float32(picked, cpu_flags() if flags is None else flags)
        if slower:
            log.warning("--dtype %s is slower than float32 here: %s (--dtype auto picks the fastest)",
                        str(picked).removeprefix("torch."), slower)
    return picked


def _eos_ids(*sources) -> tuple[int, ...]:
    """Union of EOS ids, in order; each source may be None, an int or a list of ints."""
    ids: list[int] = []
    for src in sources:
        for i in ([] if src is None else [src] if isinstance(src, int) else src):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)
