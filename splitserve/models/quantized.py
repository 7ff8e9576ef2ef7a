"""What ``--quantization`` does to each weight of a checkpoint: kept as raw blocks, quantized at
load, or expanded to the compute dtype.

A converted GGUF folder (``gguf.py``) keeps the tensors of ``layers/quant.TYPES`` as raw blocks,
listed in ``quantized.json``. The modes, for the layers a model declares quantizable (projections,
token embedding, logits head: ``LlamaForCausalLM.quantizable``):

- ``none``: every weight expanded (dequantized exactly) to the compute dtype;
- ``auto``: a tensor of a type the kernels run (Q8_0, Q4_0, Q4_1, Q4_K) stays as it is, the rest
  is expanded (a float checkpoint stays float);
- ``int8``: every one in Q8_0 (kept, or quantized from its float or dequantized values);
- ``int4``: the projections in 4 bits (Q4_0, Q4_1, Q4_K kept, the rest quantized to Q4_1), the
  embedding and the head in Q8_0 (one of the kernels' types kept as it is): the logits are the
  layer 4 bits would hurt most. Group size 32.

One layer holds one type: a merged projection (q|k|v, gate|up) whose parts would end up in
different types is expanded whole under ``auto``, and quantized whole in the mode's own type under
``int8``/``int4``. Without the compiled kernels (``layers/kernels.py``) ``auto`` expands everything
and ``int8``/``int4`` are refused.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from splitserve.layers.quant import TYPES, RawQuant

log = logging.getLogger(__name__)

MODES = ("auto", "none", "int8", "int4")
MANIFEST = "quantized.json"
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


@dataclass(frozen=True)
class Stored:
    """A checkpoint tensor stored as raw blocks."""

    kind: str  # GGML type name
    shape: tuple[int, int]


@dataclass
class Plan:
    """The type each quantized layer's tensors are loaded in (tensors not named: expanded / float)."""

    mode: str
    kinds: dict[str, str] = field(default_factory=dict)  # checkpoint tensor name -> type
    layers: dict[str, str] = field(default_factory=dict)  # module path -> type

    def summary(self) -> str:
        """``"none"``, or the types and how many checkpoint tensors each, e.g. ``"Q4_1:210,Q8_0:1"``:
        part of the model's identity that prefill and decode workers compare."""
        counts = Counter(self.kinds.values())
        return ",".join(f"{k}:{n}" for k, n in sorted(counts.items())) or "none"


def read_manifest(path: Path) -> dict[str, Stored]:
    """The raw-block tensors of a checkpoint folder (empty for an ordinary checkpoint)."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        return {}
    tensors = json.loads(file.read_text())["tensors"]
    return {name: Stored(t["type"], tuple(t["shape"])) for name, t in tensors.items()}


def write_manifest(path: Path, stored: dict[str, Stored]) -> None:
    body = {"tensors": {name: {"type": s.kind, "shape": list(s.shape)} for name, s in sorted(stored.items())}}
    (Path(path) / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")


def make_plan(layers: dict[str, tuple[str, list[str]]], stored: dict[str, Stored], mode: str,
              kernels: Optional[object]) -> Plan:
    """The plan for a model's quantizable ``layers`` (module path -> (role, tensor names)) given the
    checkpoint's raw tensors, the mode and the compiled kernels (None: not available)."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(MODES)}")
    if kernels is None:
        if mode in ("int8", "int4"):
            raise ValueError(f"--quantization {mode} needs the compiled CPU kernels, which are unavailable "
                             f"(SPLITSERVE_KERNELS=0, or their build failed: see the warning logged above)")
        if stored and mode == "auto":
            log.warning("compiled CPU kernels unavailable: every quantized weight is expanded")
        mode = "none" if mode == "auto" else mode
    plan = Plan(mode)
    if mode == "none":
        return plan
    for path, (role, names) in layers.items():
        kinds = {_target(mode, role, stored[n].kind if n in stored else None) for n in names}
        if len(kinds) > 1 and mode != "auto":  # int8 / int4: all parts in the mode's own type
            kinds = {_target(mode, role, None)}
        if len(kinds) == 1 and None not in kinds:
            kind = kinds.pop()
            plan.layers[path] = kind
            plan.kinds.update({n: kind for n in names})
        elif kinds != {None}:
            log.info("%s: its parts would be in %s; expanded", path, ", ".join(sorted(map(str, kinds))))
    return plan


def _target(mode: str, role: str, stored: Optional[str]) -> Optional[str]:
    """The type a tensor stored as ``stored`` (None: float) is loaded in, None: float."""
    if mode == "auto":
        return stored if stored in TYPES else None
    if mode == "int8" or role != "linear":
        return stored if stored == "Q8_0" or (mode == "int4" and stored in TYPES) else "Q8_0"
    return stored if stored in FOUR_BIT else "Q4_1"


def prepared(weights: Iterable[tuple[str, torch.Tensor]], stored: dict[str, Stored], plan: Plan,
             dtype: torch.dtype) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors as the plan wants them: ``RawQuant`` for a quantized layer's
    weight, a tensor (raw blocks dequantized; in ``dtype`` then) for everything else."""
    for name, tensor in weights:
        have = stored.get(name)
        want = plan.kinds.get(name)
        if want is None:
            yield name, (tensor if have is None else dequantize(have.kind, tensor, have.shape).to(dtype))
        elif have is not None and have.kind == want:
            yield name, RawQuant(want, tensor, have.shape)
        else:
            values = tensor.float() if have is None else dequantize(have.kind, tensor, have.shape)
            yield name, RawQuant(want, quantize(want, values), tuple(values.shape))


def dequantize(kind: str, raw: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Raw ``kind`` blocks -> float32 [shape] (the ``gguf`` library's dequantizer)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(raw.numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def quantize(kind: str, values: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> raw ``kind`` blocks [N, bytes per row] (the ``gguf`` library's quantizer,
    llama.cpp's reference arithmetic)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if kind == "Q4_K":
        raise ValueError("Q4_K weights are loaded as a file holds them; none are made at load")
    return torch.from_numpy(gguf_quantize(values.float().contiguous().numpy(), GGMLQuantizationType[kind]))
