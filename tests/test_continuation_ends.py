"""A continuation whose ids already end a choice ends that choice: no token more, the finish
reason and usage of the undisturbed run, and the text the client lacks of its last token (what
the undisturbed run released only at the end). Each way a choice ends: the end of sequence, a
stop string, ``max_tokens``, a structured output complete; with ``n`` = 2, a choice
ended by its ids beside one that goes on. Ids that end a choice before their last are still a
400 naming ``continuation.choices``.
"""

from __future__ import annotations

from typing import Optional

import pytest

from splitserve.engine.continuation import Continuation, replay
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.io import GenerateRequest, InvalidRequest, SamplingParams
from helpers.streamed_answers import Answer, continuation_of, stream

PROMPT = "Once upon a time, in a land far away, there lived"


def _run(engine, req) -> list:
    engine.add_request(req)
    outs = []
    while engine.has_work():
        outs += engine.step().outputs
    return outs


def _ends(engine, sp: SamplingParams, name: str, full: Optional[list] = None) -> list:
    """Run the request undisturbed (unless ``full`` is its answer), then continue it from all its
    ids: one delta, no token. Returns the undisturbed answer's deltas."""
    prompt = tuple(engine.tokenizer.encode(PROMPT))
    full = full or _run(engine, GenerateRequest(f"{name}-full", prompt, sp))
    ids = tuple(t for o in full for t in o.token_ids)
    cont = Continuation(f"cmpl-{name}", 0, ((0, ids),))
    rest = _run(engine, GenerateRequest(f"{name}-rest", prompt, sp, continuation=cont))
    assert len(rest) == 1 and rest[0].token_ids == () and rest[0].finished and rest[0].error is None, rest
    assert (rest[0].finish_reason, rest[0].completion_tokens) == (full[-1].finish_reason, full[-1].completion_tokens)
    shown = "".join(replay(IncrementalDetokenizer(engine.tokenizer, list(prompt), sp.stop), ids))
    assert shown + rest[0].text == "".join(o.text for o in full), name  # the client's text, concatenated
    s = engine.stats()
    assert s.pages_owned == 0 and not engine.live_sequences()
    return full


def test_ids_that_end_the_choice_end_it(tiny_engine):
    """``max_tokens`` reached, the end of sequence (forced by a logit bias; a stop token ends a
    choice by the same check), a stop string."""
    prompt = tuple(tiny_engine.tokenizer.encode(PROMPT))
    sp = SamplingParams(max_tokens=12, temperature=0)
    greedy = _run(tiny_engine, GenerateRequest("length-full", prompt, sp))
    assert greedy[-1].finish_reason == "length"
    text = "".join(o.text for o in _ends(tiny_engine, sp, "length", greedy))
    eos = tiny_engine.spec.eos_token_ids[0]
    _ends(tiny_engine, SamplingParams(max_tokens=12, temperature=0, logit_bias=((eos, 100.0),)), "eos")
    stopped = _ends(tiny_engine, SamplingParams(max_tokens=12, temperature=0, stop=(text[6:11],)), "stop-string")
    assert stopped[-1].finish_reason == "stop"


def test_ids_that_end_the_choice_before_their_last_are_refused(tiny_engine):
    """An id after the one that ended the choice: 400 naming continuation.choices, nothing kept."""
    prompt = tuple(tiny_engine.tokenizer.encode(PROMPT))
    eos = tiny_engine.spec.eos_token_ids[0]
    for ids in ((eos, 5), (5, 6, 7, 8, 9)):
        req = GenerateRequest("c", prompt, SamplingParams(max_tokens=4),
                              continuation=Continuation("cmpl-c", 0, ((0, ids),)))
        with pytest.raises(InvalidRequest) as err:
            tiny_engine.add_request(req)
        assert err.value.param.startswith("continuation.choices"), err.value
    assert not tiny_engine.live_sequences()


def test_a_complete_structured_output_and_n_2_end_over_http(server):
    """Through a worker: a json_schema answer continued from all its ids ends with its finish
    reason and usage and no content; ``n`` = 2 with choice 0's ids ending it and choice 1 cut
    mid-way: choice 0 ends at once, choice 1 goes on to the undisturbed text."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
            "stream_ids": True, "stream_options": {"include_usage": True}}
    events = stream(server, "/v1/chat/completions", body)
    full = Answer(events)
    assert full.finish[0] == "stop"
    cont, _ = continuation_of(events, len(events), 1)
    cont["choices"], cont["finished_tokens"] = [{"index": 0, "ids": full.ids[0]}], 0
    rest = Answer(stream(server, "/v1/chat/completions", {**body, "continuation": cont}))
    assert rest.finish == {0: "stop"} and rest.text.get(0, "") == "" and not rest.ids and rest.usage == full.usage

    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 9, "n": 2, "stream_ids": True,
            "stream_options": {"include_usage": True}}
    events = stream(server, "/v1/completions", body)
    full = Answer(events)
    cont, _ = continuation_of(events, len(events), 2)
    cont["choices"] = [{"index": 0, "ids": full.ids[0]}, {"index": 1, "ids": full.ids[1][:3]}]
    cont["finished_tokens"] = 0
    rest = Answer(stream(server, "/v1/completions", {**body, "continuation": cont}))
    assert rest.finish == full.finish and rest.text.get(0, "") == "" and rest.usage == full.usage
    assert full.ids[1][:3] + rest.ids[1] == full.ids[1] and 0 not in rest.ids
