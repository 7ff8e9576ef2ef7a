"""What a client reads when a request ends in failure, reason by reason: an ending whose detail can
name other workers (addresses, transfer agents, incarnations) or carry exception text reaches the
client as words by reason and the request id, with the status, type and ``code`` of its reason;
every other ending keeps its own words. A real split failure through a router is checked in
``test_disagg_errors.py::test_incompatible_peer_named_by_field`` (its fixture's processes)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from helpers.client_text import assert_in_words, internals_in
from splitserve.disagg.lifecycle.peers import Peer
from splitserve.disagg.lifecycle.states import DecodeState, ending_from_peer
from splitserve.disagg.lifecycle.transitions import DECODE
from splitserve.engine.colocated import ColocatedRole
from splitserve.engine.io import RequestOutput
from splitserve.errors import error_body
from splitserve.outcomes import Ending, Outcome, Reason
from splitserve.server.openai_protocol import CLIENT_WORDS, ended_error_body

PORT = 40123
PEER = Peer(f"127.0.0.1:{PORT}", "5f0c2a9e41b7d3c8", 2)
RID = "cmpl-7"

IN_WORDS = {
    Reason.PEER_LOST: [f"its transfer link decode-{PEER.incarnation}-link cannot be reached: "
                       f"ConnectionRefusedError: [Errno 111] connect to 127.0.0.1:{PORT}",
                       f"from {PEER.name}: ZMQError: Connection reset by peer",
                       f"bootstrap info names {PEER}, declared lost"],
    Reason.PEER_FAILED: [ending_from_peer("transfer_timeout").detail,
                         f"the router: prefill http://127.0.0.1:{PORT} answered 500"],
    Reason.TRANSFER_ERROR: [f"transfer backend error: nixlBackendError: NIXL_ERR_REMOTE_DISCONNECT on {PEER.name}",
                            f"the first token -1 from {PEER} is not a token of this model (vocabulary of 2048)"],
    Reason.TRANSFER_TIMEOUT: [DECODE.states[DecodeState.AWAITING_KV].timeout(SimpleNamespace(peer=PEER), "5s").detail],
    Reason.BOOTSTRAP_TIMEOUT: [f"registration from {PEER} waited 3s for the request"],
    Reason.INCOMPATIBLE_PEER: [f"page_size (ours 32, peer's 16) differs from {PEER}",
                               f"authentication failed with the prefill at 127.0.0.1:{PORT}: it closed our "
                               "connection in the handshake"],
    Reason.INTERNAL_ERROR: [f"RunAction failed: OSError: /opt/models/x.bin at 127.0.0.1:{PORT}"],
    Reason.CLIENT_ABORT: [f"the prefill worker http://127.0.0.1:{PORT} failed before it accepted the request "
                          "(ClientConnectorError: connection refused); the request failed", ""],
}
"""Reasons a client reads in words, each with details the code builds for it (``Ending(Reason.``
across ``splitserve/``)."""

KEPT = {
    Reason.REQUEST_TIMEOUT: "older than 2s",
    Reason.QUEUE_FULL: "the waiting queue is full (64 requests)",
    Reason.OVERLOADED: "queued 3s for the forward pass",
    Reason.NOT_READY: "the server is shutting down",
    Reason.LOOP_STALLED: "the engine loop has made no progress for 12s",
    Reason.STALLED: "no decode step in 10s",
    Reason.BAD_REQUEST: "max_tokens must be at least 1",
    Reason.MODEL_NOT_FOUND: "the model 'gpt-x' does not exist",
    Reason.PEER_ABORT: ending_from_peer("client_abort").detail,
}
"""Reasons whose detail is the client's to read: a bound it hit, its own input, a full or
draining worker, the peer's reason for an abort (a reason's name)."""


def test_every_reason_a_request_fails_or_aborts_with_is_decided():
    """Each failed or aborted reason is read either in words or as its own detail, not both."""
    ending = {r for r in Reason if r.outcome is not Outcome.FINISHED}
    assert set(IN_WORDS) == set(CLIENT_WORDS) and not set(IN_WORDS) & set(KEPT)
    assert set(IN_WORDS) | set(KEPT) == ending, ending - set(IN_WORDS) - set(KEPT)


@pytest.mark.parametrize("reason", list(IN_WORDS), ids=lambda r: r.value)
def test_a_detail_that_names_workers_reaches_the_client_in_words(reason):
    assert any(internals_in(d, PORT) for d in IN_WORDS[reason]), "no sample names anything internal"
    for detail in IN_WORDS[reason]:
        body = ended_error_body(RequestOutput.ended(RID, Ending(reason, detail)))
        error = body["error"]
        assert_in_words(error, reason.value, PORT)
        assert error["message"].endswith(f"(request id {RID})") and CLIENT_WORDS[reason] in error["message"], error
        expected = error_body(error["message"], reason.http_status, code=reason.value)["error"]
        assert (error["type"], error["param"]) == (expected["type"], expected["param"]), error


@pytest.mark.parametrize("reason", list(KEPT), ids=lambda r: r.value)
def test_a_detail_of_the_client_s_own_keeps_its_words(reason):
    error = ended_error_body(RequestOutput.ended(RID, Ending(reason, KEPT[reason])))["error"]
    assert error["message"] == f"{reason.value}: {KEPT[reason]}" and error["code"] == reason.value, error
    assert error["type"] == error_body("", reason.http_status)["error"]["type"], error


def test_without_a_request_id_the_words_stand_alone():
    error = ended_error_body(RequestOutput(rid="", finished=True, error="peer_lost: x", reason=Reason.PEER_LOST))
    assert error["error"]["message"] == f"peer_lost: {CLIENT_WORDS[Reason.PEER_LOST]}", error


def test_an_abort_s_detail_on_a_colocated_worker_is_logged_and_the_client_reads_words(caplog):
    """``POST /abort_request`` on a colocated worker (no lifecycle log line there): its detail is
    logged once as the request ends."""
    class Engine:
        def sequence(self, rid):
            return object()

        def abort(self, rid, ending):
            return RequestOutput.ended(rid, ending)

    role = ColocatedRole()
    role.start(SimpleNamespace(engine=Engine(), clock=time.monotonic))
    detail = IN_WORDS[Reason.CLIENT_ABORT][0]
    with caplog.at_level(logging.INFO, logger="splitserve.engine.colocated"):
        found, outs = role.abort_request(RID, None, False, detail)
    assert found and [r.getMessage() for r in caplog.records] == [f"request {RID} aborted: {detail}"], caplog.text
    assert_in_words(ended_error_body(outs[0])["error"], "client_abort", PORT)
