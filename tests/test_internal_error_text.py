"""What a client reads when a bug fails its request on a worker: the request id and no exception
text (which can name files, addresses or another request's data); other endings keep their words."""

from __future__ import annotations

from splitserve.engine.io import RequestOutput
from splitserve.outcomes import Ending, Reason
from splitserve.server.openai_protocol import ended_error_body, internal_error_text


def test_an_internal_error_body_names_the_request_not_the_exception():
    detail = "the forward pass failed: RuntimeError: /opt/models/x.bin at 10.0.0.7:5555"
    body = ended_error_body(RequestOutput.ended("r-7", Ending(Reason.INTERNAL_ERROR, detail)))["error"]
    assert body["message"] == internal_error_text("r-7") == "internal error in the worker (request id r-7)"
    assert body["code"] == "internal_error" and body["type"] == "server_error", body


def test_other_endings_keep_their_words():
    body = ended_error_body(RequestOutput.ended("r-8", Ending(Reason.REQUEST_TIMEOUT, "older than 2s")))["error"]
    assert body["message"] == "request_timeout: older than 2s" and body["code"] == "request_timeout", body
