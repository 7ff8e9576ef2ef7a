"""A ``--discovery`` value that is empty, over-long or malformed stops ``serve``, ``router`` and
``launch`` at once: exit 2, one line on stderr naming the flag, echoing at most the URL's first
80 characters and its length (never a 10 KB host), before any model loads or any store is dialled.
The same check runs wherever a URL reaches a store (``backends.backend_for``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve.config import DiscoveryConfig
from splitserve.discovery import backends as stores

HUGE_HOST = "etcd://" + "h" * 10_000 + ":2379/splitserve"
LONG_PATH = "etcd://etcd:2379/" + "p" * 2_000


def run(command: str, value: str) -> subprocess.CompletedProcess:
    # a refused value exits before anything is loaded or dialled; the timeout only stops a hang
    return subprocess.run([sys.executable, "-m", "splitserve.cli", command, "--discovery", value],
                          capture_output=True, text=True, timeout=120)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-2000:])
    assert "--discovery" in lines[0] and len(lines[0]) < 400, lines[0][:500]
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "router", "launch"])
def test_an_empty_discovery_is_a_mistake_not_no_flag(command):
    assert "empty" in one_line(run(command, ""))


@pytest.mark.parametrize("command", ["serve", "router", "launch"])
def test_a_10_kb_host_is_refused_with_its_length_not_echoed_whole(command):
    line = one_line(run(command, HUGE_HOST))
    assert f"longer than {stores.MAX_URL_CHARS}" in line and f"({len(HUGE_HOST)} characters)" in line


@pytest.mark.parametrize("url, why", [
    ("", "empty"),
    (HUGE_HOST, f"longer than {stores.MAX_URL_CHARS}"),
    ("etcd://" + "a" * 254 + ":2379/p", "at most 253"),
    (LONG_PATH, f"longer than {stores.MAX_URL_CHARS}"),
    ("etcd://h:x/p", "SCHEME://HOST[:PORT]"),
    ("etcd:///p", "SCHEME://HOST[:PORT]"),
    ("etcd://h h:1/p", "printable ASCII"),
    ("etcd://h:1/p\n", "printable ASCII"),
    ("etcd://127.1:2379/p", "no DNS name or IP address"),
    ("etcd://[fe80::1%eth0]:2379/p", "no DNS name or IP address"),
    ("etcd://a_b:2379/p", "no DNS name or IP address"),
])
def test_a_malformed_url_is_refused_before_its_store_reads_it(url, why):
    with pytest.raises(ValueError) as refused:
        stores.check(url, DiscoveryConfig())  # what the router and a worker run at start
    text = str(refused.value)
    assert text.startswith("--discovery: ") and why in text and len(text) < 400 and "\n" not in text


@pytest.mark.parametrize("url", ["etcd://etcd-0.etcd.svc:2379/splitserve", "etcds://10.0.0.1:2379/a/b",
                                 "etcd://[::1]:2379/p", "etcd://" + "a" * 253 + ":2379/p"])
def test_a_well_formed_url_passes(url):
    assert stores.check_url(url) == url
    assert stores.check(url, DiscoveryConfig()) == []


def test_the_stores_own_refusal_echoes_a_bounded_url():
    url = "etcd://h:2379/" + "?" * 900  # within the bound, no prefix: the store's own refusal
    with pytest.raises(ValueError) as refused:
        stores.check(url, DiscoveryConfig())
    assert "(914 characters)" in str(refused.value) and len(str(refused.value)) < 400


def test_the_help_of_both_flags_states_the_bounds():
    from splitserve.config import RouterConfig, ServerConfig, field_help

    for cls in (ServerConfig, RouterConfig):
        text = " ".join(field_help(cls)["discovery"].split())
        assert f"At most {stores.MAX_URL_CHARS} characters" in text and f"at most {stores.MAX_HOST_CHARS}" in text


def test_an_empty_ca_certs_is_refused_not_taken_for_plain_etcd():
    result = subprocess.run([sys.executable, "-m", "splitserve.cli", "router", "--discovery", "etcds://h:2379/p",
                             "--discovery-ca-certs", ""], capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--discovery-ca-certs: empty" in lines[0], result.stderr


@pytest.mark.parametrize("name", stores.ACCESS_FIELDS)
def test_every_discovery_access_flag_given_empty_is_refused_where_the_store_is_checked(name):
    with pytest.raises(ValueError, match=f"^--discovery-{name.replace('_', '-')}: empty"):
        stores.check("etcd://h:2379/p", DiscoveryConfig(**{name: ""}))
