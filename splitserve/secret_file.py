"""A cluster secret: a new one in a file only its owner can read (what ``splitserve launch``, the
tests and the benches hand their workers as ``--cluster-secret-file``), and the test that refuses
one that is plainly not random (:func:`why_guessable`). Apart from the control plane's CurveZMQ
code (``disagg/control/curve.py``, which reads such files), so that writing one loads no model
code: ``launch``'s supervisor stays a small process.

**The randomness test.** Each of a few fixed models of what people write instead of random bytes
(one value repeated, few distinct values, a pattern with a period, steps, printable text,
letters or digits read as base64 or hex) gives the secret's bytes a code length, the bits it
needs to write them (:data:`MODELS`). Every model is a probability distribution over byte
strings of the secret's length, and so is their even mixture (a model's choice costs
``log2(len(MODELS))`` bits). A secret is refused when the mixture writes its ``8n`` bits in at
most ``8n - REFUSE_SAVING_BITS``. At most ``2**(8n - 40)`` strings of ``n`` bytes have such a
code (Kraft's inequality), so ``n`` uniformly random bytes are refused with probability at most
``2**-40`` (below 1e-12), whatever ``n``. The test proves nothing random: it only refuses what
one of these models compresses by 40 bits."""

from __future__ import annotations

import base64
import binascii
import math
import os
import secrets
import string
from collections import Counter
from typing import Callable, Optional

MIN_SECRET_BYTES = 32
"""A cluster secret holds at least this many random bytes (``curve.parse_secret`` refuses fewer)."""
REFUSE_SAVING_BITS = 40
"""A secret that :data:`MODELS` write in this many bits fewer than its own is refused."""
CHECKED_BYTES = 4096
"""Only a secret's first bytes are judged (the rest is counted as random): its start costs bounded time."""


def write_secret_file(path: str) -> str:
    """A new cluster secret (``MIN_SECRET_BYTES`` random bytes, hex) in a new file ``path`` that only
    we can read (mode 0600, never world-readable even for a moment); ``path``, for ``--cluster-secret-file``."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(MIN_SECRET_BYTES) + "\n")
    return str(path)


def secret_bytes(text: bytes, nested: bool = True) -> Optional[bytes]:
    """A secret's bytes from the text of its file, whitespace and line breaks ignored; None when it
    is in none of these forms: hex (a ``0x`` prefix, and ``-`` or ``:`` between digits, as uuids and
    ``xxd``/``openssl -c`` write them, allowed), else base64 (standard or URL-safe, padded or not);
    base64 of such a text (``openssl rand -hex 32 | base64``, as Kubernetes Secrets are written) is
    read as the text it holds."""
    try:
        word = "".join(text.decode("ascii").split())
    except UnicodeDecodeError:
        return None
    hexed = (word[2:] if word[:2] in ("0x", "0X") else word).replace("-", "").replace(":", "")
    if hexed and len(hexed) % 2 == 0 and all(c in string.hexdigits for c in hexed) and \
            not word.startswith(("-", ":")) and "--" not in word and "::" not in word:
        return bytes.fromhex(hexed)
    if not word or not all(c in BASE64_CHARS for c in word):
        return None
    bare = word.rstrip("=").replace("-", "+").replace("_", "/")  # either alphabet, padded or not
    try:
        raw = base64.b64decode(bare + "=" * (-len(bare) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    inner = secret_bytes(raw, nested=False) if nested and all(32 <= b < 127 or b in b"\t\r\n" for b in raw) else None
    return inner if inner is not None and len(inner) >= MIN_SECRET_BYTES else raw


BASE64_CHARS = frozenset(string.ascii_letters + string.digits + "+/-_=")


def _kt_bits(seq: list[int], size: int) -> float:
    """Bits to write ``seq`` with the Krichevsky-Trofimov estimator over an alphabet of ``size``
    (adaptive: each symbol costs ``-log2((seen + 1/2) / (i + size/2))``)."""
    seen: Counter = Counter()
    bits = 0.0
    for i, s in enumerate(seq):
        bits -= math.log2((seen[s] + 0.5) / (i + size / 2))
        seen[s] += 1
    return bits


def _symbols(raw: bytes, width: int) -> tuple[list[int], int]:
    """``raw``'s bits as symbols of ``width`` bits (hex digits: 4; base64 letters: 6) and the bits left over."""
    total = 8 * len(raw)
    value, count = int.from_bytes(raw, "big"), total // width
    return [(value >> (total - width * (i + 1))) & ((1 << width) - 1) for i in range(count)], total - count * width


def _subset_bits(seq: list[int], size: int) -> float:
    """Few distinct symbols: how many (``log2 size``), which (``log2 C(size, k)``), then the KT code over them."""
    k = len(set(seq))
    return math.log2(size) + math.log2(math.comb(size, k)) + _kt_bits(seq, k)


def _within(width: int, allowed: frozenset) -> Callable[[bytes], float]:
    """Symbols of ``width`` bits all in ``allowed`` (e.g. the letters of base64): one bit to choose
    between two codes over them, each symbol alike or the KT code (which gains on repeats)."""
    def bits(raw: bytes) -> float:
        seq, rest = _symbols(raw, width)
        if not set(seq) <= allowed:
            return math.inf
        return 1 + min(len(seq) * math.log2(len(allowed)), _kt_bits(seq, len(allowed))) + rest
    return bits


def _few_values(width: int) -> Callable[[bytes], float]:
    def bits(raw: bytes) -> float:
        seq, rest = _symbols(raw, width)
        return _subset_bits(seq, 1 << width) + rest
    return bits


def _steps(raw: bytes) -> float:
    """Few distinct differences between neighbouring bytes (00 01 02 ..., 10 20 30 ...)."""
    return 8 + _subset_bits([(b - a) % 256 for a, b in zip(raw, raw[1:])], 256)


def _period(raw: bytes) -> float:
    """A block written again and again: which period (``log2 n``), then the block."""
    n = len(raw)
    for p in range(1, n):
        if raw[p:] == raw[:-p]:
            return math.log2(n) + 8 * p
    return math.inf


_B64_LETTERS = range(52)  # base64's A-Z, a-z: a passphrase read as base64
MODELS: dict[str, Callable[[bytes], float]] = {
    "few distinct byte values": _few_values(8),
    "few distinct base64 symbols": _few_values(6),
    "few distinct hex digits": _few_values(4),
    "a repeated block": _period,
    "bytes in regular steps": _steps,
    "printable text, not random bytes": _within(8, frozenset(range(0x20, 0x7F)) | {0x09, 0x0A, 0x0D}),
    "letters read as base64": _within(6, frozenset(_B64_LETTERS)),
    "lower-case letters read as base64": _within(6, frozenset(range(26, 52))),
    "upper-case letters read as base64": _within(6, frozenset(range(26))),
    "lower-case letters and digits read as base64": _within(6, frozenset(range(26, 62))),
    "letters and digits read as base64": _within(6, frozenset(range(62))),
    "decimal digits read as hex": _within(4, frozenset(range(10))),
}
"""Each a code length in bits for the bytes it is given (``inf``: not of that model)."""


def why_guessable(raw: bytes) -> Optional[str]:
    """None for a secret no model of :data:`MODELS` writes in ``REFUSE_SAVING_BITS`` bits fewer than
    its own (with the model's choice counted); else what it looks like (never its content)."""
    raw = raw[:CHECKED_BYTES]
    choice = math.log2(len(MODELS))
    best, name = min((bits(raw), name) for name, bits in MODELS.items())
    if best + choice <= 8 * len(raw) - REFUSE_SAVING_BITS:
        return name
    return None
