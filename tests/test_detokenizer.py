"""Incremental detokenization: streamed deltas concatenate to a one-shot decode of the output,
incomplete UTF-8 is held back until the end, and stop strings never leak."""

import pytest

from conftest import tiny_model
from splitserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama"))  # the tests' model cache: built once


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


class CharTokenizer:
    """Token id = one character (its code point): text in, text out, exactly."""

    def decode(self, ids, **_kw):
        return "".join(chr(i) for i in ids)


def by_chars(text: str, stop: tuple):
    """Stream ``text`` one character per token; the detokenizer and its deltas."""
    d = IncrementalDetokenizer(CharTokenizer(), [], stop)
    deltas = []
    for i, c in enumerate(text):
        d.add(ord(c))
        deltas.append(d.release(final=d.stopped or i + 1 == len(text)))
        if d.stopped:
            break
    return d, deltas


def reference(text: str, stop: tuple) -> tuple[str, bool]:
    """What the answer must be: the text up to where the first stop string to complete begins
    (of those completing at the same character, the longest)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if text[:end].endswith(s)]
        if starts:
            return text[:min(starts)], True
    return text, False


def test_stop_strings_match_as_the_reference_and_never_stream_what_is_cut():
    import random

    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 40)))
        stop = tuple({"".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))})
        d, deltas = by_chars(text, stop)
        want, stopped = reference(text, stop)
        assert ("".join(deltas), d.stopped) == (want, stopped), (text, stop)
        streamed = ""
        for delta in deltas:  # every delta is final: the answer only ever grows
            streamed += delta
            assert want.startswith(streamed), (text, stop, deltas)


def test_a_token_of_many_characters_cuts_at_the_earliest_stop_it_completes():
    d = IncrementalDetokenizer(CharTokenizer(), [], ("bcd", "abcde", "zz"))
    for c in "xx":
        d.add(ord(c))
    d._ids += [ord(c) for c in "abcd"]  # one token that decodes to "abcde" (ids are its characters)
    d.add(ord("e"))
    assert d.stopped and d.release(final=True) == "xx"


def test_what_may_still_become_a_stop_string_is_held_back():
    d = IncrementalDetokenizer(CharTokenizer(), [], ("<|end|>", "##"))
    out = ""
    for c in "hello <|en":
        d.add(ord(c))
        out += d.release(final=False)
    assert out == "hello " and not d.stopped
    for c in "x#":
        d.add(ord(c))
        out += d.release(final=False)
    assert out == "hello <|enx" and not d.stopped
    d.add(ord("#"))
    assert d.stopped and out + d.release(final=True) == "hello <|enx"


def test_stop_matching_work_per_character_does_not_grow_with_the_stop_list():
    """The worst case of the old matcher: many long stop strings that the text keeps almost
    completing. Matching is an automaton over all of them (Aho-Corasick): each character costs at
    most two steps on average, whatever the stop list; and the automaton of a stop list is built
    once and shared by every request that sends the same list."""
    from splitserve.engine.detokenizer import stop_matcher
    from splitserve.validation import MAX_STOP, MAX_STOP_CHARS

    stop = tuple("a" * (MAX_STOP_CHARS - 1) + chr(ord("b") + i) for i in range(MAX_STOP))
    d = IncrementalDetokenizer(CharTokenizer(), [], stop)
    text = ("a" * (MAX_STOP_CHARS - 2) + "y") * 20
    for c in text:
        d.add(ord(c))
        d.release(final=False)
    assert not d.stopped and d.text == text
    assert d.match_steps <= 2 * len(text), d.match_steps
    assert stop_matcher(stop) is stop_matcher(tuple(stop))
    d2 = IncrementalDetokenizer(CharTokenizer(), [], stop)
    assert d2._matcher is d._matcher
