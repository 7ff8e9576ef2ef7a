"""``splitserve make-model``: a checkpoint of a real model's shape with random weights, as GGUF files
and as a Hugging Face folder holding the same weights, so that llama.cpp, vLLM and splitserve load
the same model.

    splitserve make-model llama-3.2-1b OUT_DIR [--gguf Q4_0,Q8_0] [--no-hf] [--seed 0]

writes ``OUT_DIR/llama-3.2-1b-q4_0.gguf`` (``shape_gguf``; one file per type of Q4_0, Q8_0,
BF16, F16, F32) and ``OUT_DIR/llama-3.2-1b-bf16/`` (``shape_hf``: bfloat16 safetensors, config.json,
tokenizer). The shapes are ``shapes.SHAPES``; the weights ``shape_weights``; the tokenizer SmolLM2's
padded to the shape's vocabulary (``shape_vocab``). The BF16 GGUF file and the folder hold
bit-identical weights; Q8_0 and Q4_0 are those quantized by the ``gguf`` library. Q4_K has no
quantizer in ``gguf``: llama.cpp's ``llama-quantize`` (or ``llama_model_quantize`` in a
llama-cpp-python venv) makes it from the BF16 file.

``cached_gguf`` and ``cached_hf`` make a shape's files once into the model cache
(``cache.build_once``: locked, atomic, reused) for the benches.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Optional

FORMAT_VERSION = 1  # bump when what is written changes
REPORT = "shape.json"  # written last into a cached folder: its presence marks it complete


def make_model(name: str, out_dir, gguf_types=("Q4_0",), hf: bool = True, seed: int = 0,
               say: Callable[[str], None] = lambda line: None) -> dict[str, Path]:
    """Write the shape ``name``'s files into ``out_dir``; returns {GGUF type or "hf": path}."""
    from splitserve.models.shape_gguf import write_gguf
    from splitserve.models.shape_hf import write_hf
    from splitserve.models.shape_vocab import padded_vocabulary
    from splitserve.models.shapes import shape as find_shape

    shape = find_shape(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = padded_vocabulary(shape.vocab)
    written: dict[str, Path] = {}
    for kind in gguf_types:
        t0 = time.perf_counter()
        path = write_gguf(shape, out / f"{shape.name}-{kind.lower()}.gguf", kind, vocab, seed)
        written[kind.upper()] = path
        say(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    if hf:
        t0 = time.perf_counter()
        folder = write_hf(shape, out / f"{shape.name}-bf16", vocab, seed)
        written["hf"] = folder
        size = sum(p.stat().st_size for p in folder.iterdir())
        say(f"wrote {folder}/ ({size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    return written


def _cached(name: str, what: str, seed: int, build: Optional[Callable[[Path], None]]) -> Path:
    """The cache folder of shape ``name``'s ``what``, made by ``build`` once (None: only where it is)."""
    from splitserve.models.cache import build_once, cache_root
    from splitserve.models.shapes import shape as find_shape

    shape = find_shape(name)
    final = cache_root() / "shapes" / f"v{FORMAT_VERSION}-seed{seed}" / f"{shape.name}-{what}"
    if build is None:
        return final

    def complete(path: Path) -> bool:
        try:
            return json.loads((path / REPORT).read_text()).get("format_version") == FORMAT_VERSION
        except (OSError, ValueError):
            return False

    def build_all(tmp: Path) -> None:
        t0 = time.perf_counter()
        build(tmp)
        (tmp / REPORT).write_text(json.dumps({"format_version": FORMAT_VERSION, "shape": shape.name, "what": what,
                                              "seed": seed, "build_s": round(time.perf_counter() - t0, 1)}) + "\n")

    return build_once(final, build_all, complete)


def cached_gguf(name: str, kind: str = "Q4_0", seed: int = 0, make: bool = True) -> Path:
    """The GGUF file of shape ``name`` in ``kind``, made once into the model cache (``make``: else
    only where it is or would be)."""
    from splitserve.models.shape_gguf import write_gguf
    from splitserve.models.shape_vocab import padded_vocabulary
    from splitserve.models.shapes import shape as find_shape

    shape, kind = find_shape(name), kind.upper()
    file = f"{shape.name}-{kind.lower()}.gguf"
    folder = _cached(name, kind.lower(), seed, (lambda tmp: write_gguf(
        shape, tmp / file, kind, padded_vocabulary(shape.vocab), seed)) if make else None)
    return folder / file


def cached_hf(name: str, seed: int = 0, make: bool = True) -> Path:
    """The Hugging Face folder of shape ``name`` (bfloat16), made once into the model cache (``make``:
    else only where it is or would be)."""
    from splitserve.models.shape_hf import write_hf
    from splitserve.models.shape_vocab import padded_vocabulary
    from splitserve.models.shapes import shape as find_shape

    shape = find_shape(name)
    return _cached(name, "bf16", seed,
                   (lambda tmp: write_hf(shape, tmp, padded_vocabulary(shape.vocab), seed)) if make else None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from splitserve.models.shapes import BENCH_SHAPES, SHAPES

    parser.add_argument("shape", choices=[*SHAPES, *BENCH_SHAPES], help="the shape: a real model's sizes and "
                        "vocabulary (" + ", ".join(f"{k} = {v}" for k, v in BENCH_SHAPES.items()) + ")")
    parser.add_argument("out_dir", help="folder to write into")
    parser.add_argument("--gguf", default="Q4_0", help="comma-separated GGUF types to write, of Q4_0, Q8_0, BF16, "
                        "F16, F32, or none (default: %(default)s)")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="no Hugging Face folder")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    from splitserve.models.shape_gguf import TYPES

    kinds: list[str] = [] if args.gguf.lower() == "none" else [k.strip().upper() for k in args.gguf.split(",")]
    unknown: Optional[list] = [k for k in kinds if k not in TYPES]
    if unknown:
        raise SystemExit(f"splitserve make-model: unknown GGUF type(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(TYPES)} (Q4_K: quantize the BF16 file with llama.cpp's llama-quantize)")
    make_model(args.shape, args.out_dir, kinds, hf=args.hf, seed=args.seed, say=lambda line: print(line, flush=True))
    return 0
