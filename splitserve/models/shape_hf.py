"""A shape's random checkpoint as a Hugging Face folder: ``config.json`` (the family's spelling,
``vocab_size`` the padded one), ``generation_config.json``, the padded SmolLM2 tokenizer
(``shape_vocab.hf_tokenizer``) and the weights as one bfloat16 ``model.safetensors`` holding the
same values as the shape's GGUF file of type BF16 (``shape_weights``: the same blocks).

The safetensors file is streamed: its header names every tensor's offsets (known from the shape),
then each tensor follows a block of rows at a time, so a 6 GB file holds one block in memory. The
format: 8 bytes little-endian header length, the JSON header padded with spaces to a multiple of
8, the data.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from splitserve.models import shape_weights
from splitserve.models.shape_vocab import Vocabulary, hf_tokenizer
from splitserve.models.shapes import Shape

WEIGHTS = "model.safetensors"


def write_hf(shape: Shape, out: Path, vocab: Vocabulary, seed: int = 0) -> Path:
    """Write the folder into ``out`` (made if missing); returns it."""
    out.mkdir(parents=True, exist_ok=True)
    config = shape.hf_config(bos=vocab.bos, eos=vocab.eos, pad=vocab.pad)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": vocab.bos, "eos_token_id": vocab.eos, "pad_token_id": vocab.pad}
    (out / "generation_config.json").write_text(json.dumps(
        {k: v for k, v in generation.items() if v is not None}, indent=2) + "\n")
    hf_tokenizer(vocab, out)
    write_safetensors(shape, out / WEIGHTS, vocab, seed)
    return out


def write_safetensors(shape: Shape, path: Path, vocab: Vocabulary, seed: int = 0) -> None:
    import torch

    tensors = shape.tensors()
    header, offset = {}, 0
    for t in tensors:
        size = math.prod(t.shape) * 2
        header[t.name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors:
            for _, rows in shape_weights.blocks(t, seed, vocab.quiet):
                rows.contiguous().view(torch.int16).numpy().tofile(f)
        if f.tell() != 8 + len(text) + offset:
            raise RuntimeError(f"{path}: wrote {f.tell()} bytes, the header says {8 + len(text) + offset}")
