"""A worker keeps its own record in etcd (``discovery/etcd.py``, ``Registration``): a key deleted
under it, or overwritten with an old record of it (read from etcd's history), is put back at its
next keepalive, not only once its lease is gone. A real etcd of its own; a 2 s lease (keepalive
every second), no worker process."""

from __future__ import annotations

import time

import pytest

from etcd_server import own_etcd
from helpers.waiting import wait_for
from splitserve.discovery.etcd import Registration, client, parse_target
from splitserve.discovery.record import WorkerRecord


@pytest.fixture(scope="module")
def etcd():
    yield from own_etcd()


def test_a_deleted_or_overwritten_record_is_put_back_at_the_next_keepalive(etcd):
    target = parse_target(etcd.url("/reg-test"))
    record = WorkerRecord("d-0", "new1", "decode", "http://10.0.0.1:8000", None, "m", 1, "nixl")
    old = WorkerRecord("d-0", "old0", "decode", "http://10.0.0.1:8000", None, "m", 1, "nixl")
    registration = Registration(target, record, ttl_s=2).start()
    etcd3 = client(target)
    key = target.key(record.id)
    try:
        wait_for("registered", registration.registered.is_set, 20)

        def holds_own() -> bool:
            return etcd3.get(key) == [record.to_json()]

        wait_for("its record", holds_own, 20)
        etcd3.delete(key)
        wait_for("put back after a delete", holds_own, 20)
        etcd3.put(key, old.to_json().decode())  # an old record of it, without a lease
        wait_for("put back after an overwrite", holds_own, 20)
        lease = etcd3.lease(ttl=30)
        etcd3.put(key, record.to_json().decode(), lease=lease)  # its very value, under another lease
        wait_for("put back under its own lease", lambda: holds_own() and registration.restored >= 3, 20)
        assert registration.restored == 3
        lease.revoke()
        time.sleep(1.5)  # a keepalive more: its own value under its own lease is left alone
        assert holds_own() and registration.restored == 3
    finally:
        assert registration.revoke()
    assert etcd3.get(key) == []
