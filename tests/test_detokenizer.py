"""Incremental detokenization: streamed deltas concatenate to a one-shot decode of the output,
incomplete UTF-8 is held back until the end, and stop strings never leak."""

import pytest

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.testing.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tok"), arch="llama"))


def stream(tokenizer, ids, stop=()):
    d = IncrementalDetokenizer(tokenizer, [], stop)
    deltas = []
    for i, t in enumerate(ids):
        d.add(t)
        deltas.append(d.release(final=d.stopped or i == len(ids) - 1))
        if d.stopped:
            break
    return d, deltas


def test_deltas_add_up_to_a_one_shot_decode_even_with_a_broken_last_character(tokenizer):
    ids = tokenizer.encode("héllo wörld 日本語 🙂", add_special_tokens=False)
    for cut in range(1, len(ids) + 1):  # some cuts end in the middle of a character
        _, deltas = stream(tokenizer, ids[:cut])
        assert "".join(deltas) == tokenizer.decode(ids[:cut])
    d, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == "héllo wörld 日本語 🙂"
    assert all("\ufffd" not in x for x in deltas)


def test_a_stop_string_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    d, deltas = stream(tokenizer, ids, stop=("three",))
    assert d.stopped and "".join(deltas) == "one two "
    assert not any("th" in x for x in deltas)
