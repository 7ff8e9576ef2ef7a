"""Bootstrap info: what a prefill worker tells decode workers about itself, and the check that
decode runs before sending anything (docs/design.md §3).

Two workers can exchange KV pages only if they agree on everything that shapes a page: the model,
its layers, KV heads and head dim, the dtype, the page size, and the transfer backend (and the
control protocol version). :func:`first_mismatch` names the first field that differs, with both
values, so an ``incompatible_peer`` failure says exactly what to fix. What the pages hold
(``--kv-cache-dtype``) is in the fingerprint (``/kv-int8``: a router pairs by it) and in ``dtype``
(``int8/bfloat16``: int8 rows of a bfloat16 model); a difference there is named first.
"""

from __future__ import annotations

import hashlib
import json
import struct
import uuid
from pathlib import Path
from typing import Optional

from splitserve.disagg.protocol import PROTOCOL_VERSION, Info
from splitserve.discovery.record import kv_cache_dtype_of, with_kv_cache_dtype
from splitserve.engine.kv_pool import KVLayout

# what a checkpoint folder's tokenizer may consist of (all that are present count)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja",
                   "chat_template.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")
SAMPLE_BYTES = 1024

COMPARED_FIELDS = ("protocol_version", "model", "num_layers", "num_kv_heads", "head_dim", "dtype", "page_size",
                   "backend")


def new_incarnation() -> str:
    """A fresh id for this process start: a peer restarted on the same address is a new peer."""
    return uuid.uuid4().hex[:16]


def model_identity(spec, chat_template: Optional[str] = None, kv_cache_dtype: str = "auto") -> str:
    """``architecture:fingerprint/quantization`` of the checkpoint folder: config.json (parsed, so
    formatting does not count), every tokenizer file present (a different vocabulary or chat
    template turns the same text into different tokens), and the weights (two quantizations of one
    model share a config); then the types the worker loaded them in (``--quantization``: one file
    served quantized and expanded gives other logits). Bit-identical checkpoints loaded alike get
    the same identity wherever they live. ``chat_template``: the text of a ``--chat-template``
    that replaces the checkpoint's (it too turns the same messages into other tokens).
    ``kv_cache_dtype``: what the KV pages hold, other than ``auto`` a suffix (``/kv-int8``)."""
    path = Path(spec.path)
    digest = hashlib.sha256()
    try:
        digest.update(json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True).encode())
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                digest.update(f"\0{name}\0".encode() + (path / name).read_bytes())
        digest.update(weights_fingerprint(path).encode())
        if chat_template is not None:
            digest.update(b"\0--chat-template\0" + chat_template.encode())
    except (OSError, ValueError):
        return with_kv_cache_dtype(f"{spec.architecture}:unknown", kv_cache_dtype)
    return with_kv_cache_dtype(f"{spec.architecture}:{digest.hexdigest()[:12]}/{getattr(spec, 'quantization', 'none')}",
                               kv_cache_dtype)


def weights_fingerprint(path: Path) -> str:
    """A fingerprint of the safetensors weights in ``path`` that reads ~KiB per tensor, not the whole
    checkpoint: every tensor's name, dtype and shape, and SAMPLE_BYTES from the start, middle and
    end of its data. Another quantization, fine-tune or conversion changes nearly every value of
    the tensors it touches, so it changes these samples."""
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            base = 8 + header_len
            for name in sorted(k for k in header if k != "__metadata__"):
                info = header[name]
                start, end = info["data_offsets"]
                digest.update(json.dumps([file.name, name, info["dtype"], info["shape"]]).encode())
                middle = (start + end - SAMPLE_BYTES) // 2
                for at in sorted({start, max(start, middle), max(start, end - SAMPLE_BYTES)}):
                    f.seek(base + at)
                    digest.update(f.read(min(SAMPLE_BYTES, end - at)))
    return digest.hexdigest()


def local_info(spec, layout: KVLayout, backend: str, incarnation: str, chat_template: Optional[str] = None) -> Info:
    return Info(protocol_version=PROTOCOL_VERSION, incarnation=incarnation,
                model=model_identity(spec, chat_template, layout.kv_cache_dtype), num_layers=layout.num_layers,
                num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.pages_dtype,
                page_size=layout.page_size, backend=backend)


def first_mismatch(ours: Info, theirs: Info) -> Optional[str]:
    """``"page_size (ours 16, peer's 32)"`` for the first field that differs, or None."""
    kv = kv_cache_dtype_of(ours.model), kv_cache_dtype_of(theirs.model)
    if kv[0] != kv[1]:
        return (f"kv_cache_dtype (ours {kv[0]}, peer's {kv[1]}): prefill and decode workers must serve with "
                f"the same --kv-cache-dtype")
    for name in COMPARED_FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            return f"{name} (ours {a}, peer's {b})"
    return None
