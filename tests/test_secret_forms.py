"""The common ways people write a random cluster secret are read (``secret_file.secret_bytes``):
hex with a ``0x`` prefix or with ``-``/``:`` between digits (two uuid4s, ``xxd``), base64 of a hex
or base64 secret (``openssl rand -hex 32 | base64``, as Kubernetes Secrets hold one); a secret of
letters alone is refused with a message that says why and how to make one."""

from __future__ import annotations

import base64
import secrets
import uuid

import pytest

from splitserve.disagg.control.curve import parse_secret

RANDOM = secrets.token_bytes(32)
TAKEN = {
    "0x and hex": ("0x" + RANDOM.hex()).encode(),
    "hex with colons": ":".join(f"{b:02x}" for b in RANDOM).encode(),
    "base64 of hex and a newline": base64.b64encode((RANDOM.hex() + "\n").encode()),
    "base64 of base64": base64.b64encode(base64.b64encode(RANDOM) + b"\n"),
}


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_a_random_secret_in_a_common_form_is_read_as_its_bytes(name):
    assert parse_secret(TAKEN[name]) == RANDOM


def test_two_uuid4s_with_dashes_are_a_secret():
    one, two = uuid.uuid4(), uuid.uuid4()
    assert parse_secret(f"{one}\n{two}\n".encode()) == one.bytes + two.bytes
    assert parse_secret(f"{one}{two}".encode()) == one.bytes + two.bytes


def test_a_secret_of_letters_alone_is_refused_saying_why_and_how():
    letters = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(64))
    with pytest.raises(ValueError, match="letters alone .* make one with `head -c 32 /dev/urandom"):
        parse_secret(letters.encode())


def test_guessable_text_inside_base64_is_still_refused():
    for inner in (b"0" * 64, b"the cluster secret of splitserve".hex().encode()):
        with pytest.raises(ValueError, match="plainly not"):
            parse_secret(base64.b64encode(inner + b"\n"))
