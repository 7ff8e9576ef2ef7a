"""A shape's random checkpoint as a GGUF file, written as llama.cpp's ``convert_hf_to_gguf.py``
writes the real model: its metadata keys, its tensor names, Llama's q/k rows permuted into its
rotary layout, a ``rope_freqs`` tensor for llama3 rope scaling, no ``output`` tensor when the
embeddings are tied, the norms and biases in F32 and every matrix in one type (``TYPES``: the
``gguf`` library's quantizers for Q4_0 and Q8_0).

The file is streamed: the header and tensor table first (every tensor's size is known from the
shape), then each tensor a block of rows at a time (``shape_weights.blocks``), so writing a 3B
model holds one block, not the model. ``gguf.py`` reads the file back the other way.
"""

from __future__ import annotations

import math
from pathlib import Path

from splitserve.models import shape_weights
from splitserve.models.shape_vocab import Vocabulary, add_to_gguf, gguf_writer
from splitserve.models.shapes import Shape, Tensor, gguf_name

TYPES = ("Q4_0", "Q8_0", "BF16", "F16", "F32")
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
              "Q4_0": "MOSTLY_Q4_0"}  # general.file_type, gguf.LlamaFileType's names
ROPE_FREQS = "rope_freqs.weight"


def write_gguf(shape: Shape, path: Path, kind: str, vocab: Vocabulary, seed: int = 0) -> Path:
    """Write ``shape`` with random weights (``seed``) and matrices of type ``kind`` to ``path``."""
    import gguf

    kind = kind.upper()
    if kind not in TYPES:
        raise ValueError(f"GGUF type {kind!r} is not written here; choose one of {', '.join(TYPES)} "
                         f"(Q4_K: llama.cpp's quantizer, from a BF16 file)")
    writer = gguf_writer(path, shape.arch)
    _add_metadata(writer, shape, kind, vocab)
    plan = []  # (tensor, its GGML type)
    for tensor in shape.tensors():
        qtype = gguf.GGMLQuantizationType[kind if len(tensor.shape) == 2 else "F32"]
        plan.append((tensor, qtype))
        writer.add_tensor_info(gguf_name(tensor.name), tensor.shape, _np_float32(), _nbytes(tensor.shape, qtype),
                               raw_dtype=qtype)
    factors = rope_factors(shape) if shape.rope_scaling else None
    if factors is not None:
        writer.add_tensor_info(ROPE_FREQS, factors.shape, factors.dtype, factors.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    for tensor, qtype in plan:
        _pad(out, writer.data_alignment)
        written = sum(_write_rows(out, rows, qtype) for rows in _gguf_rows(shape, tensor, seed, vocab))
        if written != _nbytes(tensor.shape, qtype):
            raise RuntimeError(f"{tensor.name}: wrote {written} bytes, the table says {_nbytes(tensor.shape, qtype)}")
    if factors is not None:
        _pad(out, writer.data_alignment)
        factors.tofile(out)
    _pad(out, writer.data_alignment)
    writer.close()
    return path


def _add_metadata(writer, shape: Shape, kind: str, vocab: Vocabulary) -> None:
    import gguf

    writer.add_name(shape.name)
    writer.add_description(f"random weights in the shape of {shape.source} (splitserve make-model)")
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[kind]])
    if kind in ("Q4_0", "Q8_0"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(shape.max_context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if shape.arch == "llama":
        writer.add_vocab_size(shape.vocab)
        writer.add_rope_dimension_count(shape.dim)
    if shape.dim != shape.hidden // shape.heads:
        writer.add_key_length(shape.dim)
        writer.add_value_length(shape.dim)
    add_to_gguf(writer, vocab)


def _gguf_rows(shape: Shape, tensor: Tensor, seed: int, vocab: Vocabulary):
    """The tensor's bfloat16 rows as the file holds them: Llama's q/k permuted whole (small)."""
    if shape.arch == "llama" and (".q_proj." in tensor.name or ".k_proj." in tensor.name):
        heads = shape.heads if ".q_proj." in tensor.name else shape.kv_heads
        yield llama_cpp_permute(shape_weights.whole(tensor, seed), heads)
        return
    for _, rows in shape_weights.blocks(tensor, seed, vocab.quiet):
        yield rows


def llama_cpp_permute(w, heads: int):
    """llama.cpp's permutation of Llama's q/k rows (``convert_hf_to_gguf.py``'s ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_rows(out, rows, qtype) -> int:
    """Rows (bfloat16) in ``qtype``, appended to ``out``; returns the bytes written."""
    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if qtype == Q.BF16:
        data = rows.contiguous().view(torch.int16).numpy()
    elif qtype == Q.F16:
        data = rows.to(torch.float16).numpy()
    elif qtype == Q.F32:
        data = rows.float().numpy()
    else:
        data = quantize(rows.float().numpy(), qtype)
    data.tofile(out)
    return data.nbytes


def _nbytes(shape: tuple[int, ...], qtype) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def _pad(out, alignment: int) -> None:
    out.write(bytes(-out.tell() % alignment))


def _np_float32():
    import numpy as np

    return np.dtype(np.float32)


def rope_factors(shape: Shape):
    """The ``rope_freqs`` tensor llama.cpp's converter writes for llama3 rope scaling (its formula)."""
    import numpy as np

    rope = shape.rope_scaling
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for freq in 1.0 / shape.rope_theta ** (np.arange(0, shape.dim, 2, dtype=np.float32) / shape.dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = ((rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"])
                      / (rope["high_freq_factor"] - rope["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)
