"""The cluster secret's randomness test (``secret_file.why_guessable``, through
``curve.parse_secret``): what plainly is not random bytes is refused naming why and never
repeating it; what every generator of the project writes is taken; and each model is a
sub-probability, the fact the bound of ``2**-40`` on refusing random bytes rests on."""

from __future__ import annotations

import base64
import itertools
import math
import secrets
import subprocess

import pytest

from splitserve.disagg.control.curve import ClusterSecret, parse_secret
from splitserve.secret_file import MODELS, REFUSE_SAVING_BITS, why_guessable, write_secret_file

GUESSABLE = {
    "64 zero hex digits": "0" * 64,
    "a 43-letter passphrase read as base64": "correcthorsebatterystaplecorrecthorsebatter",
    "a placeholder read as base64": "replacemeclustersecretreplacemeclustersecret",
    "the same letter 44 times": "Q" * 44,
    "base64 of a sentence": base64.b64encode(b"correct horse battery staple, twice!").decode(),
    "base64 of a lower-case word": base64.b64encode(b"splitserveclustersecretsplitserve").decode(),
    "hex of a sentence": b"the cluster secret of splitserve".hex(),
    "a counting sequence": bytes(range(32)).hex(),
    "a random half written twice": secrets.token_hex(16) * 2,
    "deadbeef": "deadbeef" * 8,
    "every hex digit in order": "0123456789abcdef" * 4,
    "upper-case letters read as base64": "".join(secrets.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(44)),
}


@pytest.mark.parametrize("name", sorted(GUESSABLE))
def test_a_guessable_secret_file_is_refused_naming_why_never_what(tmp_path, name):
    """Each of these decodes to 32 bytes or more, so the old length check took it."""
    text = GUESSABLE[name]
    path = tmp_path / "secret"
    path.write_text(text + "\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match=f"--cluster-secret-file {path}: a cluster secret is random bytes, and "
                                         "this one is plainly not") as info:
        ClusterSecret.load(str(path))
    assert text not in str(info.value) and text[:12] not in str(info.value)
    assert any(model in str(info.value) for model in MODELS)


def test_every_way_the_project_makes_a_secret_is_taken(tmp_path):
    """``write_secret_file`` (launch, the tests' fixtures, the benches), the docs' ``head -c 32
    /dev/urandom | base64`` run in a shell, and random bytes of other lengths in hex and in both
    base64 alphabets, wrapped or not: 1,000 secrets, none refused (each with probability at most
    ``2**-40``, so this fails falsely with probability below 1e-9)."""
    for i in range(20):
        ClusterSecret.load(write_secret_file(str(tmp_path / f"launch{i}")))
    for _ in range(5):
        out = subprocess.run(["sh", "-c", "head -c 32 /dev/urandom | base64"], capture_output=True, check=True)
        parse_secret(out.stdout)
    for i in range(1000):
        raw = secrets.token_bytes(32 + i % 97)
        text = [raw.hex(), base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode().rstrip("="),
                base64.encodebytes(raw).decode()][i % 4]
        assert parse_secret(text.encode()) == raw, i


def _kraft_sums(n: int) -> dict[str, float]:
    """Each model's sum of 2**-L over every string of ``n`` bytes."""
    strings = [bytes(t) for t in itertools.product(range(256), repeat=n)]
    return {name: math.fsum(2.0 ** -bits(s) for s in strings) for name, bits in MODELS.items()}


def test_each_model_is_a_sub_probability_over_every_byte():
    """Kraft's inequality, summed exactly over every string of 1 byte (of 2: ``make check-long``):
    each model's code lengths L give sum(2**-L) <= 1, so their even mixture does too, and at most
    2**(8n - 40) strings of n bytes can be written in 8n - 40 bits: a refused share of at most
    2**-40."""
    for name, total in _kraft_sums(1).items():
        assert total <= 1 + 1e-9, (name, total)
    assert REFUSE_SAVING_BITS == 40
    assert why_guessable(bytes(32)) is not None and why_guessable(secrets.token_bytes(32)) is None


@pytest.mark.long
def test_each_model_is_a_sub_probability_over_every_two_bytes():
    for name, total in _kraft_sums(2).items():
        assert total <= 1 + 1e-9, (name, total)
