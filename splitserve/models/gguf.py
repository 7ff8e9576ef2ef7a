"""GGUF checkpoints: a llama.cpp ``.gguf`` file converted once into a cached Hugging Face checkpoint
folder, which ``loader.load_model`` then loads like any other (README, *GGUF files*).

``gguf_checkpoint(file)`` returns the folder, converting on the first call only: it lives under the
model cache (``cache.cache_root()/gguf/<key>/<file stem>``, built by ``cache.build_once``: locked,
atomic, reused), keyed by the file's resolved path, size and modification time and by
FORMAT_VERSION; the folder's basename is the file's stem, so the served model name is that stem.

A conversion uses ``transformers``' GGUF integration and the ``gguf`` library; nothing of
llama.cpp's layout is re-implemented here. It writes ``config.json`` (transformers' mapping, plus
what it leaves out: ``architectures``, ``head_dim``, Mistral as ``LlamaForCausalLM``, a
``rope_freqs`` tensor as ``llama3`` rope scaling); the weights as safetensors shards (of at most
SHARD_BYTES), renamed and un-permuted by transformers' tensor processor, the kernels' types
(``layers/quant.TYPES``) as raw blocks listed in ``quantized.json``, F16/BF16 as they are, the rest
dequantized exactly to float32; the tokenizer (chat template included); ``generation_config.json``
(EOS: the eos, eot and eom ids); and last ``gguf_source.json``, whose presence marks a finished
folder. A tensor with no place in the model, a missing one, a wrong shape, a type outside
TENSOR_TYPES or an architecture outside ARCHITECTURES is an error naming it. The conversion holds
one shard of weights in memory at a time, never the whole model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from splitserve.models.cache import build_once, cache_root

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: the kernels' types as raw blocks (1: everything dequantized)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ARCHITECTURE_NOTES = {"llama": "llama (Llama 2/3, Mistral, SmolLM2)", "qwen2": "qwen2", "qwen3": "qwen3"}
# GGML type name -> the torch dtype its tensors expand to (layers/quant.TYPES are stored as raw blocks)
TENSOR_TYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "Q8_0": "float32", "Q4_0": "float32", "Q4_1": "float32", "Q5_0": "float32", "Q5_1": "float32",
    "Q2_K": "float32", "Q3_K": "float32", "Q4_K": "float32", "Q5_K": "float32", "Q6_K": "float32",
}
SHARD_BYTES = 2 << 30
SOURCE_NAME = "gguf_source.json"
ROPE_FREQS = "rope_freqs.weight"
# the llama3 rope scaling Llama 3.1 / 3.2 / 3.3 use (their factor is read from rope_freqs)
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class GGUFError(ValueError):
    """A GGUF file this server cannot load: the message names the file and what is unsupported."""


def find_gguf(path: os.PathLike | str) -> Optional[Path]:
    """The GGUF file ``--model PATH`` means: PATH itself if it is a ``.gguf`` file, the one ``.gguf``
    file in PATH if it is a folder without config.json, else None (not a GGUF checkpoint). A
    folder holding several is an error listing them."""
    path = Path(path).expanduser()
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        return path.resolve()
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        raise GGUFError(f"{str(path)!r} holds several GGUF files ({', '.join(p.name for p in found)}): "
                        f"pass --model with the one to serve")
    return found[0].resolve() if found else None


def gguf_checkpoint(gguf_file: os.PathLike | str) -> Path:
    """The converted checkpoint folder for ``gguf_file``, converting it on first use (see above)."""
    src = Path(gguf_file).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(src)!r} does not exist")
    final = cache_root() / "gguf" / f"{_source_key(src)}-v{FORMAT_VERSION}" / src.stem
    if not _is_complete(final):
        log.info("converting %s into %s (first start only)", src, final)
    return build_once(final, lambda tmp: convert_gguf(src, tmp), _is_complete)


def convert_gguf(gguf_file: os.PathLike | str, out_dir: os.PathLike | str) -> Path:
    """Write the Hugging Face checkpoint of ``gguf_file`` into ``out_dir`` (see the module docstring)."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    src, out = Path(gguf_file).resolve(), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        reader = GGUFReader(str(src))
    except (ValueError, OSError) as e:
        raise GGUFError(f"{src}: not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    check_supported(reader, src)

    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    config = _complete_config(config, reader, arch, src)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    stored = _write_weights(reader, arch, config, skeleton, out, src)
    config.dtype = stored
    config.save_pretrained(str(out))
    _write_generation_config(reader, out)
    _write_tokenizer(src, out)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    stat = src.stat()
    (out / SOURCE_NAME).write_text(json.dumps({
        "format_version": FORMAT_VERSION, "gguf": str(src), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "architecture": arch, "tensor_types": dict(sorted(types.items())), "stored_dtype": stored,
        "convert_s": round(time.perf_counter() - t0, 2), "versions": _versions(),
    }, indent=2) + "\n")
    log.info("converted %s in %.1f s", src.name, time.perf_counter() - t0)
    return out


def check_supported(reader, src: Path) -> None:
    """GGUFError naming the architecture or the tensor types (with a tensor of each) we cannot load."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{src.name}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(ARCHITECTURE_NOTES.values())}")
    bad: dict[str, str] = {}  # type -> its first tensor
    for t in reader.tensors:
        if t.tensor_type.name not in TENSOR_TYPES:
            bad.setdefault(t.tensor_type.name, t.name)
    if bad:
        listed = ", ".join(f"{kind} (e.g. {name})" for kind, name in bad.items())
        raise GGUFError(f"{src.name}: unsupported GGUF tensor type {listed}; supported: {', '.join(TENSOR_TYPES)}")


def dequantize(tensor):
    """A GGUF reader tensor as a torch tensor in its stored dtype (TENSOR_TYPES), numpy's axis order
    ([out_features, in_features] for a matrix); the ``gguf`` library's dequantizer does the work."""
    import numpy as np
    import torch
    from gguf.quants import dequantize as gguf_dequantize

    kind = tensor.tensor_type.name
    if kind not in TENSOR_TYPES:
        raise GGUFError(f"unsupported GGUF tensor type {kind} ({tensor.name}); supported: {', '.join(TENSOR_TYPES)}")
    values = np.array(gguf_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a copy: not the mmap
    return torch.from_numpy(values).to(getattr(torch, TENSOR_TYPES[kind]))


# -- the parts of a conversion ---------------------------------------------------------------------


def _complete_config(config, reader, arch: str, src: Path):
    """What transformers' metadata mapping leaves out (module docstring)."""
    from transformers import LlamaConfig

    if config.model_type == "mistral":  # transformers' name for a llama-architecture file named mistral
        fields = {k: v for k, v in config.to_dict().items()
                  if k not in ("model_type", "architectures", "sliding_window", "transformers_version")}
        config = LlamaConfig(**fields)
    if config.model_type != arch:
        raise GGUFError(f"{src.name}: transformers read GGUF architecture {arch!r} as model type "
                        f"{config.model_type!r}, which splitserve does not serve")
    config.architectures = [ARCHITECTURES[arch]]
    key_length = _field(reader, f"{arch}.attention.key_length")
    value_length = _field(reader, f"{arch}.attention.value_length")
    if key_length is not None:
        if value_length is not None and value_length != key_length:
            raise GGUFError(f"{src.name}: attention key length {key_length} != value length {value_length}; "
                            f"splitserve needs them equal")
        config.head_dim = int(key_length)
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        config.rope_parameters = _llama3_rope(config, dequantize(rope_freqs), src)
    return config


def _llama3_rope(config, factors, src: Path) -> dict:
    """The llama3 rope scaling whose per-frequency divisors llama.cpp stored as ``rope_freqs``."""
    import torch

    from splitserve.layers.rotary import inv_frequencies

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = float((config.rope_parameters or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    factors = factors.float()
    scaling = {"rope_type": "llama3", "rope_theta": theta, "factor": float(factors.max()), **LLAMA3_ROPE}
    implied = inv_frequencies(head_dim, theta) / inv_frequencies(head_dim, theta, scaling)
    if factors.shape != implied.shape or not torch.allclose(factors, implied, rtol=1e-4, atol=1e-6):
        raise GGUFError(f"{src.name}: its {ROPE_FREQS} tensor is not llama3 rope scaling with "
                        f"low/high frequency factors 1/4 and original context 8192; no other is supported")
    return scaling


def _write_weights(reader, arch: str, config, skeleton, out: Path, src: Path) -> str:
    """Rename and un-permute every tensor into safetensors shards (the kernels' types as raw
    blocks, the rest dequantized); returns config.json's ``dtype`` (what most weights expand to)."""
    import torch
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    from splitserve.layers.quant import TYPES as KEPT
    from splitserve.models.quantized import Stored, write_manifest

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    with _one_gguf_name_table():
        name_map = get_gguf_hf_weights_map(skeleton, processor)
    expected = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    shard: dict[str, torch.Tensor] = {}
    files: list[Path] = []
    unplaced: list[str] = []
    elements: Counter = Counter()
    raw: dict[str, Stored] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # became the rope scaling in config.json
        kind = tensor.tensor_type.name
        kept = kind in KEPT and len(tensor.shape) == 2
        weights = torch.from_numpy(tensor.data.copy()) if kept else dequantize(tensor)  # a copy: not the mmap
        # the processor only permutes rows: raw rows [N, bytes] go through it as they are
        result = processor.process(weights=weights.numpy() if kept else weights.float().numpy(), name=tensor.name,
                                   tensor_key_mapping=name_map, parsed_parameters={"tensors": {}})
        hf_name = name_map.get(result.name)
        if expected.get(hf_name) is None:  # no place in the model, or placed already
            unplaced.append(tensor.name)
            continue
        value = torch.from_numpy(result.weights.copy()).to(weights.dtype)
        shape = (int(tensor.shape[1]), int(tensor.shape[0])) if kept else tuple(value.shape)  # GGUF: [K, N]
        if shape != expected[hf_name]:
            raise GGUFError(f"{src.name}: tensor {tensor.name} ({hf_name}) has shape {shape}; "
                            f"the model needs {expected[hf_name]}")
        if kept:
            raw[hf_name] = Stored(kind, shape)
        if shard and sum(t.nbytes for t in shard.values()) + value.nbytes > SHARD_BYTES:
            files.append(_save_shard(shard, out, len(files) + 1))
            shard = {}
        shard[hf_name] = value
        expected[hf_name] = None  # placed
        elements[TENSOR_TYPES[kind] if kept else str(value.dtype).removeprefix("torch.")] += math.prod(shape)
    if unplaced:
        raise GGUFError(f"{src.name}: tensor(s) with no place in a {ARCHITECTURES[arch]}: {_some(unplaced)}")
    missing = [name for name, shape in expected.items() if shape is not None]
    if missing:
        raise GGUFError(f"{src.name}: the model needs tensor(s) the file lacks: {_some(missing)}")
    files.append(_save_shard(shard, out, len(files) + 1))
    if raw:
        write_manifest(out, raw)
    if len(files) == 1:
        os.rename(files[0], out / "model.safetensors")
    else:
        _write_index(files, out)
    return elements.most_common(1)[0][0]


def _save_shard(tensors: dict, out: Path, number: int) -> Path:
    from safetensors.torch import save_file

    path = out / f"model-{number:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)  # save_file makes it private; the cache is an ordinary folder
    return path


def _write_index(files: list[Path], out: Path) -> None:
    from safetensors import safe_open

    weight_map = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            weight_map.update({name: path.name for name in f.keys()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=2) + "\n")


def _some(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _write_generation_config(reader, out: Path) -> None:
    from transformers import GenerationConfig

    eos: list[int] = []
    for key in EOS_KEYS:
        value = _field(reader, key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    GenerationConfig(bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"), eos_token_id=eos or None,
                     pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id")).save_pretrained(str(out))


def _write_tokenizer(src: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    except Exception as e:  # transformers raises several types for a tokenizer it cannot convert
        raise GGUFError(f"{src.name}: transformers cannot convert its tokenizer: {type(e).__name__}: {e}") from e
    tokenizer.save_pretrained(str(out))


@contextlib.contextmanager
def _one_gguf_name_table():
    """``get_gguf_hf_weights_map`` recurses into every submodule and rebuilds gguf's name table for
    each (~400 times for a 30-layer model: seconds); the table depends only on (arch, layers)."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _source_key(src: Path) -> str:
    stat = src.stat()
    return hashlib.sha256(f"{src}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _is_complete(path: Path) -> bool:
    try:
        source = json.loads((path / SOURCE_NAME).read_text())
    except (OSError, ValueError):
        return False
    return source.get("format_version") == FORMAT_VERSION and (path / "config.json").is_file()


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("gguf", "transformers", "torch")}
