"""Every host and URL a worker or router takes is in one form, or refused at once: a worker URL
(``record.check_url``) with a query or fragment mark, a bracketed non-IPv6 host, a zone id or an
IPv4 alias is refused, and its aliases (``[0::1]``, port ``0080``, upper case) come out as one
string, so the worker set's de-duplication sees one address; ``--host`` and ``--advertise-host``
forms a worker cannot listen on or register are refused before anything starts."""

from __future__ import annotations

import pytest

from splitserve.config import ServerConfig
from splitserve.discovery.record import check_url


@pytest.mark.parametrize("url", ["http://x:80?", "http://x:80#", "http://x:80/?", "http://[v1.fe]:80",
                                 "http://[fe80::1%25eth0]:80", "http://127.1:80", "http://0x7f.0.0.1:80",
                                 "http://127.000.0.1:80", "http://1.2.3.4.5:80", "http://[1.2.3.4]:80"])
def test_a_url_that_is_no_plain_address_or_an_alias_of_one_is_refused(url):
    with pytest.raises(ValueError, match="HOST:PORT"):
        check_url(url)


def test_aliases_of_one_url_come_out_as_one_string():
    assert {check_url(u) for u in ("http://[::1]:80", "http://[::1]:0080", "http://[0:0::1]:80/",
                                   "HTTP://[0::1]:80")} == {"http://[::1]:80"}
    assert check_url("http://Host.Example:8000") == "http://host.example:8000"
    assert check_url("http://10.0.0.5:30001") == "http://10.0.0.5:30001"


def test_the_worker_set_sees_an_alias_as_the_address_it_is():
    from splitserve.config import RouterConfig, WorkerAddress
    from splitserve.router.membership import parse_worker
    from splitserve.router.workers import Worker, WorkerSet

    workers = WorkerSet.from_config(RouterConfig(prefill=(WorkerAddress("http://[0::1]:0080", 8998),),
                                                 decode=(WorkerAddress("http://127.0.0.1:8001"),)))
    assert [w.url for w in workers.all()] == ["http://[::1]:80", "http://127.0.0.1:8001"]
    fields = parse_worker({"url": "http://[::1]:080", "worker_type": "prefill"})
    with pytest.raises(ValueError, match="already in the set"):
        workers.add(Worker("prefill", fields["url"], 8998, id="p-2"))


@pytest.mark.parametrize("host, words", [("[::1]", "without brackets: ::1"), ("::1%lo", "zone id"),
                                         ("fe80::1%25lo", "zone id"), ("a b", "not a host name")])
def test_a_host_a_worker_cannot_listen_on_is_refused_saying_which_form(host, words):
    from splitserve.hosts import check_bind_host

    with pytest.raises(ValueError, match=words):
        check_bind_host(host)


def test_good_listening_hosts_pass():
    from splitserve.hosts import check_bind_host

    for host in ("::1", "0:0::1", "127.0.0.1", "0.0.0.0", "::", "localhost", "worker-0.svc"):
        assert check_bind_host(host) == host


def test_the_advertised_url_is_bracketed_once_and_a_zone_id_stops_the_worker():
    from splitserve.server.registration import advertised_url, check_discovery

    def config(advertise: str) -> ServerConfig:
        return ServerConfig(role="decode", host="::1", advertise_host=advertise, port=8000,
                            discovery="etcd://127.0.0.1:1/p")

    for advertise in ("[::1]", "::1", "0:0::1"):
        check_discovery(config(advertise))
        assert advertised_url(config(advertise), 8000, tls=False) == "http://[::1]:8000"
    for advertise in ("fe80::1%lo", "::1%25lo", "[fe80::1%lo]"):
        with pytest.raises(ValueError, match="no router takes"):
            check_discovery(config(advertise))


def test_an_allowed_prefill_entry_that_reads_as_an_address_and_as_one_with_a_port_is_refused():
    from splitserve.auth import parse_allowed_prefill

    for entry in ("::1:8998", "fe80::1:2"):
        with pytest.raises(ValueError, match=r"ambiguous: an IPv6 address with a port is written \[ADDRESS\]:PORT"):
            parse_allowed_prefill(entry)
    assert parse_allowed_prefill("[::1]:8998,::1,2001:db8::1,[fe80::1:2]").addresses == {
        ("[::1]", 8998), ("[::1]", None), ("[2001:db8::1]", None), ("[fe80::1:2]", None)}
