"""A shape's GGUF file in Q4_K_M, for the benches: the ``gguf`` library has no K-quant quantizer, so
llama.cpp's own (``refs/quantize.py``, run by the llama-cpp-python reference venv's python) makes it
from the shape's BF16 file (``splitserve make-model``'s), once, into the model cache beside the
shape's other files. ``tensor_types`` names what each tensor became: Q4_K_M keeps some tensors in
Q6_K, and llama.cpp falls back to another type where a row is not a multiple of 256 (Qwen2.5-0.5B's
896 and 4864).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

QUANTIZE = Path(__file__).resolve().parent / "refs" / "quantize.py"
KIND = "Q4_K_M"
TYPES = "tensor_types.json"


def q4k_gguf(shape_name: str, ref_python: str | None, make: bool = True, seed: int = 0) -> Path:
    """The Q4_K_M file of shape ``shape_name``, made once (``make``: else only where it is or would be)."""
    from splitserve.models.cache import build_once, cache_root
    from splitserve.models.make_model import FORMAT_VERSION, cached_gguf
    from splitserve.models.shapes import shape

    s = shape(shape_name)
    final = cache_root() / "shapes" / f"v{FORMAT_VERSION}-seed{seed}" / f"{s.name}-{KIND.lower()}"
    name = f"{s.name}-{KIND.lower()}.gguf"
    if not make or (final / TYPES).is_file():
        return final / name
    if not ref_python:
        raise SystemExit(f"{KIND} needs llama.cpp's quantizer: the llama-cpp-python venv of "
                         f"bench/refs/setup_llamacpp.sh (--llamacpp-python)")

    def build(tmp: Path) -> None:
        src = cached_gguf(s.name, "BF16", seed)
        subprocess.run([ref_python, str(QUANTIZE), str(src), str(tmp / name), KIND], check=True,
                       stdout=sys.stderr)  # llama.cpp logs each tensor's type: the bench's stdout stays its own
        (tmp / TYPES).write_text(json.dumps(tensor_types(tmp / name), indent=1) + "\n")

    return build_once(final, build, lambda p: (p / TYPES).is_file()) / name


def tensor_types(path: Path) -> dict[str, list[str]]:
    """{GGML type name: the names of the tensors of that type} of a GGUF file."""
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf.reader import GgufHeader

    found: dict[str, list[str]] = defaultdict(list)
    for t in GgufHeader.from_file(str(path)).tensors:
        found[GGMLQuantizationType(t.ggml_type).name].append(t.name)
    return dict(found)


def tensor_bytes(path: Path) -> int:
    from transformers.integrations.gguf.reader import GgufHeader

    return sum(t.nbytes for t in GgufHeader.from_file(str(path)).tensors)
