"""How many characters of a prompt one token of a tokenizer can stand for, at most: a text prompt
too long in characters for the context is refused before it is tokenized."""

from __future__ import annotations

import json
from typing import Optional

_KEEPS = {"Prepend", "NFD", "NFKD", "Lowercase"}  # normalizers that never shorten a text
_COMPOSES = {"NFC", "NFKC"}  # may fold up to MAX_COMPOSED characters into one
MAX_COMPOSED = 4
"""The most characters Unicode composes into one (the longest canonical decomposition, e.g.
U+1F82 GREEK SMALL LETTER ALPHA WITH PSILI AND VARIA AND YPOGEGRAMMENI)."""
_SPLITS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}  # keep every character


def max_chars_per_token(tokenizer) -> Optional[int]:
    """At most how many characters of a prompt one token of ``tokenizer`` stands for, or None when
    no such bound is known (then a prompt is tokenized before its length is checked).

    Why it holds, for a Hugging Face fast tokenizer. It normalizes the text, splits it
    (pre-tokenizer) and cuts each piece into tokens of its vocabulary, whose strings, joined, are
    the pieces again. So one token stands for at most as many characters of the normalized text as
    its string is long: with ``ByteLevel`` each character of a token's string is one byte, and a
    character is at least one byte; with ``Metaspace`` each is one character (``▁`` a space); a
    byte-fallback token (``<0xE3>``) stands for less than one; and an added token found in the text
    as is (``<|im_start|>``) for its content. Normalizing can shorten a text only by composing
    characters (NFC, NFKC), at most :data:`MAX_COMPOSED` into one. So a text of ``C`` characters
    has at least ``C / (L * S)`` tokens, where ``L`` is the longest token string (vocabulary and
    added tokens) and ``S`` is 4 with a composing normalizer, else 1; a chat template only adds
    text (the bound is taken on what it renders). A step that may drop characters (a normalizer
    that strips or replaces, a pre-tokenizer that removes whitespace), a fused unknown token
    (WordPiece's ``[UNK]`` for a whole word) or a tokenizer of another kind: no bound (None).
    Measured: 43 for the tiny model, 81 for SmolLM2 (its longest token is a newline and 80
    spaces); the byte tokenizer of the tests: 4 (``</s>``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:
        return None
    model = spec.get("model") or {}
    fold = _normalizer_fold(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if fold is None or not _keeps_characters(pre):
        return None
    byte_level = "ByteLevel" in json.dumps(pre)
    if model.get("type") == "BPE":
        if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback") \
                and not byte_level:
            return None  # a run of unknown characters may become one token
    elif model.get("type") != "Unigram" or not model.get("byte_fallback"):
        return None
    vocab = model.get("vocab")
    strings = vocab.keys() if isinstance(vocab, dict) else [piece[0] for piece in vocab or ()]
    longest = max([len(s) for s in strings] + [len(a.get("content", "")) for a in spec.get("added_tokens") or ()],
                  default=0)
    return longest * fold if longest > 0 else None


def _normalizer_fold(n: Optional[dict]) -> Optional[int]:
    """How many characters the normalizer may fold into one (1: it never shortens); None: unknown."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind == "Sequence":
        folds = [_normalizer_fold(x) for x in n.get("normalizers") or ()]
        return None if None in folds else max(folds, default=1)  # composing twice composes no further
    if kind in _KEEPS:
        return 1
    if kind in _COMPOSES:
        return MAX_COMPOSED
    if kind == "Replace":
        pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
        if isinstance(pattern, str) and isinstance(content, str) and len(content) >= len(pattern) > 0:
            return 1
    return None


def _keeps_characters(p: Optional[dict]) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(x) for x in p.get("pretokenizers") or ())
    return kind in _SPLITS and p.get("behavior") != "Removed"
