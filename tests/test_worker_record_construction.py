"""A worker record is checked by the same rules however it is made: ``WorkerRecord(...)`` refuses
each record ``parse_record`` refuses, with the same error, so a worker cannot write (``to_json``)
a record that routers refuse; a record both accept reads back equal, its URL in one form."""

from __future__ import annotations

import json

import pytest

from splitserve.discovery.record import WorkerRecord, parse_record

GOOD = dict(id="p-0", incarnation="0123abcd", role="prefill", url="http://10.0.0.1:8000", bootstrap_port=8998,
            model="org/model@abc", protocol_version=1, transfer_backend="nixl")
DECODE = {**GOOD, "id": "d-0", "role": "decode", "bootstrap_port": None}

BAD = [
    {"id": ""}, {"id": "a b"}, {"id": 5}, {"id": "-x"}, {"id": "x" * 129},
    {"incarnation": ""}, {"incarnation": "ab-cd"}, {"incarnation": None},
    {"role": "router"}, {"role": None},
    {"url": "http://10.0.0.1:8000/path"}, {"url": "http://user@10.0.0.1:8000"}, {"url": "ftp://10.0.0.1:21"},
    {"url": "http://127.1:8000"}, {"url": "http://10.0.0.1"}, {"url": "http://h:8000\n"}, {"url": 8000},
    {"url": "http://" + "a" * 400 + ":1"},
    {"bootstrap_port": None}, {"bootstrap_port": 0}, {"bootstrap_port": 65536}, {"bootstrap_port": True},
    {"bootstrap_port": "8998"},
    {"model": ""}, {"model": "a b"}, {"model": None}, {"model": "m" * 257},
    {"protocol_version": -1}, {"protocol_version": True}, {"protocol_version": "1"}, {"protocol_version": 1 << 31},
    {"transfer_backend": "ucx"}, {"transfer_backend": None},
    {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "int8"}, {"model": "m/kv-int8", "kv_cache_dtype": "auto"},
    {"role": "router", "model": None},  # two wrong: the same one named first both ways
]


@pytest.mark.parametrize("change", BAD, ids=lambda change: json.dumps(change)[:40])
def test_a_bad_record_is_refused_alike_when_built_and_when_parsed(change):
    fields = {**GOOD, **change}
    with pytest.raises(ValueError) as built:
        WorkerRecord(**fields)
    with pytest.raises(ValueError) as parsed:
        parse_record(json.dumps(fields))
    assert str(built.value) == str(parsed.value)


def test_a_decode_with_a_bootstrap_port_is_refused_alike():
    fields = {**DECODE, "bootstrap_port": 8998}
    with pytest.raises(ValueError, match="bootstrap_port") as built:
        WorkerRecord(**fields)
    with pytest.raises(ValueError) as parsed:
        parse_record(fields)
    assert str(built.value) == str(parsed.value)


@pytest.mark.parametrize("fields", [GOOD, DECODE, {**GOOD, "model": "m/kv-int8", "kv_cache_dtype": "int8"},
                                    {**DECODE, "url": "https://[0::1]:0443/", "kv_cache_dtype": "auto"}])
def test_a_built_record_reads_back_equal_in_one_form(fields):
    record = WorkerRecord(**fields)
    assert parse_record(record.to_json()) == record
    assert parse_record(json.dumps(fields)) == record


def test_a_built_record_holds_its_url_in_the_one_form_routers_read():
    record = WorkerRecord(**{**DECODE, "url": "http://[0::1]:0080/"})
    assert record.url == "http://[::1]:80" and record.kv_cache_dtype == "auto"


def test_null_kv_cache_dtype_in_json_is_refused_though_none_is_derived_when_built():
    assert WorkerRecord(**{**GOOD, "model": "m/kv-int8"}).kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        parse_record(json.dumps({**GOOD, "kv_cache_dtype": None}))
