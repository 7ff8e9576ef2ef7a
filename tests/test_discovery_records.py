"""What discovery takes from etcd and from the command line (``splitserve/discovery/``): records
validated like the network input they are, ``--discovery`` targets, and etcd's auth against a real
etcd. Cheap: one etcd of its own, no worker."""

from __future__ import annotations

import json

import pytest
import requests

from etcd_server import own_etcd
from splitserve.discovery.etcd import Credentials, Target, client, parse_target
from splitserve.discovery.record import MAX_RECORD_BYTES, parse_record

GOOD = {"id": "p-0", "incarnation": "0123abcd", "role": "prefill", "url": "http://10.0.0.5:30001",
        "bootstrap_port": 8998, "model": "LlamaForCausalLM:abcdef012345/none", "protocol_version": 4,
        "transfer_backend": "nixl"}


def test_a_good_record_round_trips():
    record = parse_record(json.dumps(GOOD))
    assert parse_record(record.to_json()) == record and record.identity == ("p-0", "0123abcd")
    decode = parse_record({**GOOD, "role": "decode", "bootstrap_port": None, "url": "https://[fd00::5]:443/"})
    assert decode.url == "https://[fd00::5]:443" and decode.bootstrap_port is None


@pytest.mark.parametrize("change, words", [
    ({"url": "http://user:pw@10.0.0.5:1"}, "url"), ({"url": "http://10.0.0.5"}, "url"),
    ({"url": "http://10.0.0.5:1/path"}, "url"), ({"url": "http://10.0.0.5:1?x=1"}, "url"),
    ({"url": "file:///etc/passwd"}, "url"), ({"url": "http://bad host:1"}, "url"), ({"url": 5}, "url"),
    ({"url": "http://10.0.0.5:1\t"}, "url"), ({"url": "http://10.0.\r\n0.5:1"}, "url"),
    ({"url": "http://10.0.0.5:1/\n"}, "url"), ({"url": "http://1\t0.0.0.5:1"}, "url"),
    ({"bootstrap_port": 0}, "port"), ({"bootstrap_port": 70000}, "port"), ({"bootstrap_port": True}, "port"),
    ({"bootstrap_port": "8998"}, "port"), ({"role": "decode"}, "decode worker has none"),
    ({"role": "colocated"}, "role"), ({"id": ""}, "id"), ({"id": "a/b"}, "id"), ({"id": "x" * 200}, "id"),
    ({"incarnation": "not-hex!"}, "incarnation"), ({"model": "has space"}, "model"), ({"model": ""}, "model"),
    ({"protocol_version": -1}, "protocol_version"), ({"protocol_version": 1.5}, "protocol_version"),
    ({"transfer_backend": "carrier-pigeon"}, "transfer_backend"), ({"surprise": 1}, "unknown fields")])
def test_a_bad_record_is_refused_naming_its_field(change, words):
    with pytest.raises(ValueError, match=words):
        parse_record(json.dumps({**GOOD, **change}))


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b"\xff\xfe", b"null", b"x" * (MAX_RECORD_BYTES + 1)])
def test_what_is_no_record_at_all_is_refused(data):
    with pytest.raises(ValueError):
        parse_record(data)


def test_discovery_targets():
    assert parse_target("etcd://10.0.0.2:2379/splitserve") == Target("10.0.0.2", 2379, "/splitserve")
    assert parse_target("etcds://etcd.svc:2379/a/b/").key("p-0") == "/a/b/workers/p-0"
    assert parse_target("etcds://etcd.svc:2379/a").tls
    for bad in ("http://h:1/p", "etcd://h/p", "etcd://h:1", "etcd://h:1/", "etcd://h:1/a//b", "etcd://u@h:1/p",
                "etcd://h:1/../p", "etcd://h:1/p\n", "etcd://h:1/a\tb", "etcd://h\r:1/p"):
        with pytest.raises(ValueError, match="--discovery"):
            parse_target(bad)


def test_a_worker_that_cannot_register_does_not_start(tmp_path):
    from splitserve.config import DiscoveryConfig, ServerConfig
    from splitserve.server.registration import check_discovery

    for config, words in ((ServerConfig(role="colocated", discovery="etcd://h:1/p"), "prefill and decode"),
                          (ServerConfig(role="decode", host="0.0.0.0", discovery="etcd://h:1/p"), "--advertise-host"),
                          (ServerConfig(role="decode", discovery="etcd://h:1/p", discovery_ttl_s=1), "ttl"),
                          (ServerConfig(role="decode", discovery="etcd://h:1/p",
                                        discovery_access=DiscoveryConfig(user="u")), "go together"),
                          (ServerConfig(role="decode", discovery="etcd:/h"), "--discovery")):
        with pytest.raises(ValueError, match=words):
            check_discovery(config)


@pytest.fixture(scope="module")
def etcd():
    yield from own_etcd()


def test_a_user_and_password_open_an_etcd_with_auth_and_nothing_else_does(etcd, tmp_path):
    v3 = etcd.http + "/v3"
    for path, body in (("/auth/role/add", {"name": "root"}), ("/auth/user/add", {"name": "root", "password": "pw"}),
                       ("/auth/user/grant", {"user": "root", "role": "root"}), ("/auth/enable", {})):
        r = requests.post(v3 + path, json=body, timeout=10)
        assert r.status_code == 200, (path, r.text)
    target = parse_target(etcd.url("/auth-test"))
    password = tmp_path / "password"
    password.write_text("pw\n")
    password.chmod(0o600)
    etcd_ok = client(target, Credentials(user="root", password_file=str(password)))
    etcd_ok.put(target.key("w"), "v")
    assert etcd_ok.get(target.key("w")) == [b"v"]
    with pytest.raises(Exception):
        client(target).get(target.key("w"))  # no token: refused
    password.write_text("wrong\n")
    with pytest.raises(ConnectionError, match="refused user"):
        client(target, Credentials(user="root", password_file=str(password)))


def test_a_sealed_record_opens_only_under_its_key():
    from splitserve.discovery.signing import RecordSeal, Unverified

    record, seal = parse_record(GOOD), RecordSeal(b"k" * 32)
    sealed = seal.seal(record)
    assert seal.open(sealed) == record and RecordSeal().open(sealed) == record  # no key: read unverified
    assert RecordSeal().open(record.to_json()) == record
    envelope = json.loads(sealed)
    forged = {**envelope, "record": {**envelope["record"], "url": "http://10.6.6.6:1"}}
    for value, words in ((record.to_json(), "unsigned"), (RecordSeal(b"j" * 32).seal(record), "badly signed"),
                         (json.dumps(forged), "badly signed"), (json.dumps({**envelope, "hmac": "0" * 64}), "badly"),
                         (json.dumps({**envelope, "hmac": 5}), "badly signed")):
        with pytest.raises(Unverified, match=words):
            seal.open(value)
    for value in (b"not json", json.dumps({"record": {**GOOD, "url": "x"}, "hmac": "0" * 64}), "x" * 5000):
        with pytest.raises(ValueError):
            seal.open(value)


def test_a_password_in_the_clear_is_said_at_start_by_router_and_worker(tmp_path, caplog):
    import logging

    from splitserve.config import DiscoveryConfig, RouterConfig, ServerConfig
    from splitserve.discovery.etcd import plaintext_password
    from splitserve.router.app import create_app
    from splitserve.server.registration import discovery_warnings

    creds = Credentials(user="u", password_file="p")
    assert "in the clear" in plaintext_password(parse_target("etcd://h:1/p"), creds)
    assert plaintext_password(parse_target("etcds://h:1/p"), creds) is None
    assert plaintext_password(parse_target("etcd://h:1/p"), Credentials(user="u", password_file="p",
                                                                        ca_certs="ca.pem")) is None
    assert plaintext_password(parse_target("etcd://h:1/p"), Credentials()) is None
    said = discovery_warnings(ServerConfig(role="decode", discovery="etcd://h:1/p",
                                           discovery_access=DiscoveryConfig(user="u", password_file="p")))
    assert any("in the clear" in s for s in said) and any("unsigned" in s for s in said)
    with caplog.at_level(logging.WARNING, logger="splitserve.router.app"):
        create_app(RouterConfig(discovery="etcd://h:1/p", discovery_access=DiscoveryConfig(user="u", password_file="p")))
    assert "in the clear" in caplog.text and "whoever can write to etcd" in caplog.text
