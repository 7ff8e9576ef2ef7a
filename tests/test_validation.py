"""validate_request: every rule, no server. The error names the field (``param`` and message)."""

from __future__ import annotations

import pytest

from splitserve.engine.io import DEFAULT_MAX_TOKENS, InvalidRequest
from splitserve.validation import RequestContext, parse_json_body, validate_request

MODEL = "tiny"


def ok(body, endpoint="completions", **kw):
    kw.setdefault("served_model_name", MODEL)
    return validate_request(body, endpoint, RequestContext(**kw))


def bad(body, endpoint="completions", param=None, match=None, status=400, **kw):
    kw.setdefault("served_model_name", MODEL)
    with pytest.raises(InvalidRequest) as info:
        validate_request(body, endpoint, RequestContext(**kw))
    err = info.value
    assert err.status == status, str(err)
    if param is not None:
        assert err.param == param, str(err)
        assert param.split(".")[-1].split("[")[0] in str(err), f"message does not name {param}: {err}"
    if match is not None:
        assert match in str(err), str(err)
    return err


# -- body --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"{not json", b"", b"   ", b"\xff\xfe", b"[1, 2]", b'"prompt"', b"null",
                                 b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}'])
def test_body_must_be_a_json_object(raw):
    with pytest.raises(InvalidRequest) as info:
        validate_request(raw, "completions")
    assert info.value.status == 400


def test_raw_bytes_and_dicts_are_the_same():
    assert ok(b'{"prompt": "hi", "max_tokens": 3}') == ok({"prompt": "hi", "max_tokens": 3})
    assert parse_json_body('{"a": 1}') == {"a": 1}


# -- defaults ----------------------------------------------------------------------------------------


def test_defaults():
    r = ok({"prompt": "hi"})
    assert r.sampling.max_tokens == DEFAULT_MAX_TOKENS and not r.max_tokens_set
    assert r.sampling.temperature == 1.0 and r.sampling.top_p == 1.0 and r.sampling.top_k == 0
    assert r.sampling.stop == () and r.sampling.seed is None and not r.sampling.ignore_eos
    assert not r.stream and not r.include_usage and r.model is None and r.rid is None
    assert r.prompt_text == "hi" and r.prompt_ids is None  # no tokenizer given


def test_generation_defaults_apply_only_when_not_given():
    gd = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    r = ok({"prompt": "hi"}, generation_defaults=gd)
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k) == (0.6, 0.9, 20)
    r = ok({"prompt": "hi", "temperature": 0, "top_p": 1, "top_k": -1}, generation_defaults=gd)
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k) == (0.0, 1.0, 0)
    assert r.sampling.greedy


def test_missing_model_means_the_served_one_and_unknown_is_404():
    assert ok({"prompt": "hi"}).model is None
    assert ok({"prompt": "hi", "model": MODEL}).model == MODEL
    err = bad({"prompt": "hi", "model": "gpt-4"}, param="model", status=404, match="gpt-4")
    assert err.code == "model_not_found"
    assert validate_request({"prompt": "hi", "model": "any"}, "completions").model == "any"  # no name: no check


# -- types -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("max_tokens", 1.0), ("max_tokens", "16"), ("temperature", True),
    ("temperature", "0.5"), ("top_p", False), ("top_k", 1.5), ("top_k", True), ("seed", True), ("seed", 1.0),
    ("stream", 1), ("stream", "true"), ("ignore_eos", 0), ("stop", 5), ("stop", [1]), ("stop", {"a": 1}),
    ("stop_token_ids", 5), ("stop_token_ids", [True]), ("stop_token_ids", ["1"]), ("user", 5),
    ("rid", 5), ("bootstrap_host", 1), ("bootstrap_port", "80"), ("bootstrap_room", True), ("model", 1),
])
def test_wrong_types(field, value):
    assert bad({"prompt": "hi", field: value}, param=field).status == 400


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.01), ("top_p", -1),
    ("top_k", -2), ("seed", -1), ("seed", 2**63), ("bootstrap_port", 0), ("bootstrap_port", 70000),
    ("bootstrap_room", -1), ("bootstrap_room", 2**63), ("stop", ""), ("stop", ["a", ""]),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop_token_ids", [-1]), ("rid", ""), ("rid", "has space"),
])
def test_out_of_range(field, value):
    assert bad({"prompt": "hi", field: value}, param=field).status == 400


def test_accepted_values():
    r = ok({"prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 2**63 - 1,
            "stop": ["a", "b", "a"], "stop_token_ids": [1, 2], "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "user": "u1", "rid": "req-1", "bootstrap_host": "10.0.0.1",
            "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1})
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.0, 0.5, 3, 2**63 - 1)
    assert s.stop == ("a", "b") and s.stop_token_ids == (1, 2) and s.ignore_eos
    assert r.stream and r.include_usage and r.max_tokens_set
    assert (r.rid, r.bootstrap_host, r.bootstrap_port, r.bootstrap_room) == ("req-1", "10.0.0.1", 8998, 2**63 - 1)
    assert ok({"prompt": "hi", "stop": "x"}).sampling.stop == ("x",)
    assert ok({"prompt": "hi", "temperature": 2}).sampling.temperature == 2.0  # int is a number


def test_null_means_absent():
    r = ok({"prompt": "hi", "max_tokens": None, "temperature": None, "stop": None, "n": None, "logprobs": None,
            "echo": None, "stream": None, "seed": None, "suffix": None})
    assert r.sampling.max_tokens == DEFAULT_MAX_TOKENS and r.sampling.temperature == 1.0


def test_stream_options():
    bad({"prompt": "hi", "stream_options": {"include_usage": True}}, param="stream_options", match="stream")
    bad({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}},
        param="stream_options.include_usage")
    bad({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        param="stream_options.continuous_usage_stats")
    bad({"prompt": "hi", "stream": True, "stream_options": "yes"}, param="stream_options")
    assert not ok({"prompt": "hi", "stream": True, "stream_options": {}}).include_usage


# -- unsupported OpenAI fields and unknown fields ----------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("best_of", 3), ("suffix", "end"),
])
def test_unsupported_completion_fields_are_named(field, value):
    assert bad({"prompt": "hi", field: value}, param=field, match="not supported").param == field


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {}),
    ("modalities", ["text", "audio"]), ("reasoning_effort", "high"),
])
def test_unsupported_chat_fields_are_named(field, value):
    err = bad({"messages": [{"role": "user", "content": "hi"}], field: value}, "chat", param=field,
              match="not supported")
    assert err.param == field


@pytest.mark.parametrize("endpoint,body,param", [
    ("completions", {"logprobs": 21}, "logprobs"), ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"), ("completions", {"logprobs": 10**6}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"), ("chat", {"logprobs": True, "top_logprobs": 10**3}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"), ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
    ("generate", {"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("generate", {"top_logprobs_num": 3}, "top_logprobs_num"),
    ("generate", {"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ("generate", {"return_text_in_logprobs": "yes"}, "return_text_in_logprobs"),
])
def test_bad_logprobs_fields_are_named(endpoint, body, param):
    base = {"completions": {"prompt": "hi"}, "chat": {"messages": [{"role": "user", "content": "hi"}]},
            "generate": {"input_ids": [1]}}[endpoint]
    assert bad({**base, **body}, endpoint, param=param).param == param


def test_logprobs_fields_set_the_alternatives():
    assert ok({"prompt": "hi", "logprobs": 0}).sampling.logprobs == 0
    assert ok({"prompt": "hi", "logprobs": 20}).sampling.logprobs == 20
    assert ok({"prompt": "hi"}).sampling.logprobs is None
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert ok({**chat, "logprobs": True}, "chat").sampling.logprobs == 0
    assert ok({**chat, "logprobs": True, "top_logprobs": 5}, "chat").sampling.logprobs == 5
    assert ok({**chat, "logprobs": False, "top_logprobs": 0}, "chat").sampling.logprobs is None
    gen = ok({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True,
              "logprob_start_len": -1}, "generate")
    assert gen.sampling.logprobs == 3 and gen.return_text_in_logprobs and gen.sampling.prompt_logprobs is None


def test_n_is_bounded():
    assert ok({"prompt": "hi", "n": 16}).sampling.n == 16
    assert ok({"messages": [{"role": "user", "content": "hi"}], "n": 3}, "chat").sampling.n == 3
    assert ok({"prompt": "hi"}).sampling.n == 1
    for n in (0, 17, 10**6, 2.0, True):
        bad({"prompt": "hi", "n": n}, param="n")
    bad({"prompt": "hi", "n": 2, "echo": True, "max_tokens": 0}, param="n")
    assert ok({"input_ids": [1], "sampling_params": {"n": 4}}, "generate").sampling.n == 4  # SGLang's
    for n in (0, 17, 2.0):
        bad({"input_ids": [1], "sampling_params": {"n": n}}, "generate", param="sampling_params.n")
    bad({"input_ids": [1], "return_logprob": True, "logprob_start_len": 0,
         "sampling_params": {"n": 2, "max_new_tokens": 0}}, "generate", param="sampling_params.n")
    assert ok({"prompt": "hi", "n": 2, "response_format": {"type": "json_object"}}).sampling.n == 2


def test_echo_and_logprob_start_len_ask_for_the_prompts_logprobs():
    echo = ok({"prompt": "hi", "echo": True, "logprobs": 2, "max_tokens": 0})
    assert echo.echo and echo.sampling.prompt_logprobs == 2 and echo.sampling.max_tokens == 0
    plain = ok({"prompt": "hi", "echo": True})
    assert plain.echo and plain.sampling.prompt_logprobs is None
    bad({"prompt": "hi", "max_tokens": 0}, param="max_tokens")
    bad({"prompt": "hi", "echo": "yes"}, param="echo")
    gen = ok({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 4,
              "sampling_params": {"max_new_tokens": 0}}, "generate")
    assert gen.logprob_start_len == 1 and gen.sampling.prompt_logprobs == 4 and gen.sampling.max_tokens == 0
    bad({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3}, "generate",
        param="logprob_start_len")
    bad({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}}, "generate",
        param="sampling_params.max_new_tokens")


def test_noop_values_of_unsupported_fields_are_accepted():
    # accepted, and they change nothing: the same request as without them
    assert ok({"prompt": "hi", "n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0,
               "logit_bias": {}, "suffix": ""}) == ok({"prompt": "hi"})
    messages = [{"role": "user", "content": "hi"}]
    plain = ok({"messages": messages}, "chat")
    assert ok({"messages": messages, "n": 1, "logprobs": False, "tools": [], "tool_choice": "none",
               "response_format": {"type": "text"}, "presence_penalty": 0}, "chat") == plain


def test_unknown_fields_are_refused():
    assert bad({"prompt": "hi", "max_token": 5}, param="max_token", match="unrecognized").status == 400
    bad({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, "chat", param="prompt")
    bad({"prompt": "hi", "messages": []}, param="messages")
    bad({"text": "hi", "sampling_params": {"max_tokens": 3}}, "generate", param="sampling_params.max_tokens")


# -- prompts -----------------------------------------------------------------------------------------


def test_completion_prompts():
    bad({}, param="prompt", match="required")
    bad({"prompt": ""}, param="prompt", match="empty")
    bad({"prompt": []}, param="prompt", match="empty")
    bad({"prompt": 5}, param="prompt")
    bad({"prompt": ["a", "b"]}, param="prompt", match="batched")
    bad({"prompt": [[1], [2]]}, param="prompt", match="batched")
    bad({"prompt": [1, "a"]}, param="prompt")
    bad({"prompt": [1, 300]}, param="prompt", vocab_size=258, match="300")
    assert ok({"prompt": ["single"]}).prompt_text == "single"
    assert ok({"prompt": [1, 2, 3]}).prompt_ids == (1, 2, 3)
    assert ok({"prompt": [[4, 5]]}).prompt_ids == (4, 5)


def test_chat_messages(byte_tokenizer):
    bad({}, "chat", param="messages", match="required")
    bad({"messages": []}, "chat", param="messages", match="empty")
    bad({"messages": "hi"}, "chat", param="messages")
    bad({"messages": ["hi"]}, "chat", param="messages[0]")
    bad({"messages": [{"role": "robot", "content": "hi"}]}, "chat", param="messages[0].role")
    bad({"messages": [{"role": "tool", "content": "hi"}]}, "chat", param="messages[0].tool_call_id")
    bad({"messages": [{"role": "function", "content": "hi"}]}, "chat", param="messages[0].role", match="tools")
    bad({"messages": [{"role": "user", "content": None}]}, "chat", param="messages[0].content")
    bad({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "chat",
        param="messages[0].content", match="image_url")
    bad({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "chat",
        param="messages[0].tool_calls")
    r = ok({"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
           "chat", tokenizer=byte_tokenizer)
    assert r.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"})
    expected = byte_tokenizer.apply_chat_template(list(r.messages), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    assert list(r.prompt_ids) == list(expected)
    assert byte_tokenizer.decode(r.prompt_ids).endswith("<assistant>")


def test_chat_max_completion_tokens():
    msgs = [{"role": "user", "content": "hi"}]
    assert ok({"messages": msgs, "max_completion_tokens": 9}, "chat").sampling.max_tokens == 9
    assert ok({"messages": msgs, "max_tokens": 8}, "chat").sampling.max_tokens == 8
    bad({"messages": msgs, "max_completion_tokens": 0}, "chat", param="max_completion_tokens")
    bad({"messages": msgs, "max_completion_tokens": 5, "max_tokens": 6}, "chat", param="max_tokens")


def test_tokenized_completion_prompt(byte_tokenizer):
    r = ok({"prompt": "héllo"}, tokenizer=byte_tokenizer)
    assert list(r.prompt_ids) == byte_tokenizer.encode("héllo")
    assert r.generate_request("r1").prompt_ids == r.prompt_ids


# -- context -----------------------------------------------------------------------------------------


def test_context_limit_names_both_numbers():
    err = bad({"prompt": list(range(100)), "max_tokens": 50}, param="max_tokens", max_context=120)
    assert "100" in str(err) and "50" in str(err) and "120" in str(err)
    ok({"prompt": list(range(100)), "max_tokens": 20}, max_context=120)


def test_default_max_tokens_shrinks_to_what_the_context_leaves():
    r = ok({"prompt": list(range(100))}, max_context=120)
    assert r.sampling.max_tokens == 20 and not r.max_tokens_set
    err = bad({"prompt": list(range(120))}, param="prompt", max_context=120)
    assert "120" in str(err)


def test_context_check_on_tokenized_text(byte_tokenizer):
    err = bad({"prompt": "x" * 9000, "max_tokens": 256}, param="max_tokens", tokenizer=byte_tokenizer,
              max_context=8192)
    assert str(err) == "prompt has 9000 tokens and max_tokens is 256, but the model's context is 8192"


# -- /generate ---------------------------------------------------------------------------------------


def test_generate_text_and_input_ids(byte_tokenizer):
    r = ok({"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "top_k": -1,
                                              "stop": ["x"] * 6, "stop_token_ids": [257], "ignore_eos": True,
                                              "seed": 5}, "stream": True, "rid": "abc"},
           "generate", tokenizer=byte_tokenizer)
    assert r.prompt_ids == tuple(byte_tokenizer.encode("hi")) and r.stream and r.rid == "abc"
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.stop, s.stop_token_ids, s.ignore_eos, s.seed) == \
        (4, 0.0, 0, ("x",), (257,), True, 5)
    r = ok({"input_ids": [1, 2, 3]}, "generate")
    assert r.prompt_ids == (1, 2, 3) and r.sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert ok({"input_ids": [1], "sampling_params": {"sampling_seed": 3}}, "generate").sampling.seed == 3


def test_generate_errors():
    assert bad({}, "generate", param="text", match="exactly one").status == 400
    bad({"text": "a", "input_ids": [1]}, "generate", param="text", match="exactly one")
    bad({"text": ""}, "generate", param="text")
    bad({"text": ["a", "b"]}, "generate", param="text", match="batch")
    bad({"input_ids": []}, "generate", param="input_ids")
    bad({"input_ids": [[1], [2]]}, "generate", param="input_ids", match="batch")
    bad({"input_ids": [1, 99]}, "generate", param="input_ids", vocab_size=50)
    bad({"input_ids": [1], "sampling_params": []}, "generate", param="sampling_params")
    bad({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "generate",
        param="sampling_params.max_new_tokens")
    bad({"input_ids": [1], "sampling_params": {"temperature": -1}}, "generate", param="sampling_params.temperature")
    bad({"input_ids": [1], "sampling_params": {"top_p": 0}}, "generate", param="sampling_params.top_p")
    bad({"input_ids": [1], "sampling_params": {"repetition_penalty": 2.5}}, "generate",
        param="sampling_params.repetition_penalty")
    bad({"input_ids": [1], "sampling_params": {"seed": 1, "sampling_seed": 2}}, "generate",
        param="sampling_params.seed")
    bad({"input_ids": [1], "return_logprob": 1}, "generate", param="return_logprob")
    bad({"input_ids": [1], "stream_options": {"include_usage": True}, "stream": True}, "generate",
        param="stream_options")
    bad({"input_ids": [1], "model": "other"}, "generate", param="model", status=404)
    bad({"input_ids": [1], "return_hidden_states": True}, "generate", param="return_hidden_states")
    noops = {"n": 1, "repetition_penalty": 1.0, "skip_special_tokens": True, "min_new_tokens": 0}
    assert ok({"input_ids": [1], "sampling_params": noops}, "generate") == ok({"input_ids": [1]}, "generate")


def test_fields_sglang_gateway_adds_are_accepted_at_their_defaults():
    # what `sglang_router.launch_router --pd-disaggregation` 0.3.2 adds to each request it forwards
    # accepted, and at these values they change nothing: the same request as without them
    bootstrap = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 31998, "bootstrap_room": 7}
    generate = {"input_ids": [1], "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}, **bootstrap}
    assert ok({**generate, "model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
               "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
               "return_entropy": False}, "generate") == ok(generate, "generate")
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0.0}
    assert ok({**completion, "stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
               "skip_special_tokens": True, "return_hidden_states": False}, "completions") == ok(completion)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "model": MODEL, "max_completion_tokens": 8,
            "stream": True, "temperature": 0.0}
    assert ok({**chat, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False}, "chat") == ok(chat, "chat")
    bad({"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True}, "chat",
        param="continue_final_message")


def test_generate_context_limit():
    err = bad({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 10}}, "generate",
              param="sampling_params.max_new_tokens", max_context=15)
    assert "10 tokens" in str(err) and "15" in str(err)


def test_unknown_endpoint_is_a_programming_error():
    with pytest.raises(ValueError):
        validate_request({}, "embeddings")


# -- text: no lone surrogates ------------------------------------------------------------------------


@pytest.mark.parametrize("body,endpoint,param", [
    ({"prompt": "hi \ud800 there"}, "completions", "prompt"),
    ({"prompt": "x", "stop": ["ok", "\udfff"]}, "completions", "stop[1]"),
    ({"prompt": "x", "cache_salt": "\ud800"}, "completions", "cache_salt"),
    ({"prompt": "x", "user": "\ud800"}, "completions", "user"),
    ({"prompt": "x", "model": "\ud800"}, "completions", "model"),
    ({"prompt": "x", "\ud800": 1}, "completions", None),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "chat", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "chat",
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}, "chat", "messages[0].name"),
    ({"text": "\ud800"}, "generate", "text"),
    ({"input_ids": [1], "sampling_params": {"stop": "\ud800"}}, "generate", "sampling_params.stop"),
    ({"input_ids": [1], "cache_salt": "\ud800"}, "generate", "cache_salt"),
])
def test_a_lone_surrogate_anywhere_is_refused_naming_its_field(body, endpoint, param, byte_tokenizer):
    """A lone surrogate is legal JSON ("\\ud800") but no text: it cannot be encoded as UTF-8, so it
    would raise wherever the request is hashed (``cache_salt``), tokenized or forwarded. It is
    refused before any of that, raw or already parsed, with or without a tokenizer."""
    import json

    raw = json.dumps(body).encode()
    assert b"\\ud" in raw.lower()
    for given in (raw, body):
        for tok in (None, byte_tokenizer):
            err = bad(given, endpoint, tokenizer=tok)
            assert err.param == param and "surrogate" in str(err), str(err)
            str(err).encode("utf-8")  # the message itself is printable and encodable


def test_a_surrogate_pair_is_one_character_and_accepted(byte_tokenizer):
    r = ok(b'{"prompt": "smile \\ud83d\\ude00", "cache_salt": "\\ud83d\\ude00"}', tokenizer=byte_tokenizer)
    assert r.prompt_text == "smile \U0001F600" and r.cache_salt == "\U0001F600"


# -- caps on stop conditions -------------------------------------------------------------------------


def test_stop_conditions_are_capped_in_count_and_length_on_every_route():
    """One request's stop conditions are bounded (``MAX_STOP*``): what matching them costs per
    token, and what the worker holds for them, cannot grow with what a client sends."""
    from splitserve.validation import MAX_OPENAI_STOP, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

    assert MAX_OPENAI_STOP <= MAX_STOP and MAX_STOP * MAX_STOP_CHARS <= 4096
    long_ok, too_long = "s" * MAX_STOP_CHARS, "s" * (MAX_STOP_CHARS + 1)
    ids_ok, too_many_ids = list(range(MAX_STOP_TOKEN_IDS)), list(range(MAX_STOP_TOKEN_IDS + 1))
    routes = [({"prompt": "x"}, "completions", "", MAX_OPENAI_STOP),
              ({"messages": [{"role": "user", "content": "x"}]}, "chat", "", MAX_OPENAI_STOP),
              ({"input_ids": [1]}, "generate", "sampling_params.", MAX_STOP)]
    for base, endpoint, prefix, count in routes:
        def body(**fields):
            return {**base, "sampling_params": fields} if prefix else {**base, **fields}

        stops = [f"{i:02d}" + long_ok[2:] for i in range(count)]
        r = ok(body(stop=stops, stop_token_ids=ids_ok), endpoint)
        assert len(r.sampling.stop) == count and r.sampling.stop_token_ids == tuple(ids_ok)
        bad(body(stop=stops + ["more"]), endpoint, param=prefix + "stop", match=f"at most {count}")
        bad(body(stop=["a", too_long]), endpoint, param=prefix + "stop", match=f"{MAX_STOP_CHARS} characters")
        bad(body(stop=too_long), endpoint, param=prefix + "stop", match=f"{MAX_STOP_CHARS} characters")
        bad(body(stop_token_ids=too_many_ids), endpoint, param=prefix + "stop_token_ids",
            match=f"at most {MAX_STOP_TOKEN_IDS}")


# -- a prompt too long in characters to fit ----------------------------------------------------------


class CountingTokenizer:
    """``byte_tokenizer`` that counts what it tokenizes."""

    def __init__(self, inner):
        self.inner, self.encoded = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, *a, **kw):
        self.encoded += 1
        return self.inner.encode(text, *a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.encoded += bool(kw.get("tokenize"))
        return self.inner.apply_chat_template(*a, **kw)


def test_a_prompt_too_long_in_characters_is_refused_before_it_is_tokenized(byte_tokenizer):
    from splitserve.validation import max_chars_per_token

    per = max_chars_per_token(byte_tokenizer)
    assert per == 4  # one byte a token, but "</s>" in the text is one token of 4 characters
    tok = CountingTokenizer(byte_tokenizer)
    kw = dict(tokenizer=tok, max_context=100, chars_per_token=per)
    err = bad({"prompt": "a" * 400}, param="prompt", match="at least 100 tokens (400 characters", **kw)
    assert "more than 4" in str(err) and tok.encoded == 0
    bad({"prompt": "a" * 200, "max_tokens": 60}, param="max_tokens", match="at least 50 tokens", **kw)
    bad({"messages": [{"role": "user", "content": "a" * 390}]}, "chat", param="prompt", match="at least", **kw)
    bad({"text": "a" * 400}, "generate", param="prompt", match="at least", **kw)
    assert tok.encoded == 0
    # what may fit is tokenized and checked as before: exact counts in the message
    bad({"prompt": "a" * 396}, param="prompt", match="prompt has 396 tokens", **kw)
    assert tok.encoded == 1
    assert ok({"prompt": "</s>" * 99}, **kw).prompt_ids == (257,) * 99  # the bound is a bound: it fits


def test_the_characters_per_token_bound_holds_and_is_refused_where_it_is_not_known(byte_tokenizer, monkeypatch):
    """The bound is derived from the tokenizer's own parts (``max_chars_per_token``): checked on
    the tiny model's tokenizer against texts made of its longest tokens, and refused for parts
    that may drop characters."""
    import copy
    import json as _json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    from conftest import CACHE_DIR
    from splitserve.models.resolve import resolve_model_dir
    from splitserve.validation import max_chars_per_token

    monkeypatch.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))  # the tiny model the servers of the suite use
    tiny = AutoTokenizer.from_pretrained(resolve_model_dir("tiny"))
    per = max_chars_per_token(tiny)
    vocab = tiny.get_vocab()
    longest = sorted(vocab, key=len)[-20:]
    for text in ["".join(tiny.convert_tokens_to_string([t]) for t in longest) * 30, "<|im_start|>" * 500,
                 " " * 5000, "日本語🙂" * 700, "a" * 10000]:
        assert len(tiny.encode(text)) * per >= len(text), text[:40]

    spec = _json.loads(byte_tokenizer.backend_tokenizer.to_str())

    def variant(**parts):
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_json.dumps({**copy.deepcopy(spec), **parts})))

    assert max_chars_per_token(variant(normalizer={"type": "NFC"})) == 16  # 4 characters may compose into one
    assert max_chars_per_token(variant(normalizer={"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "_"}, {"type": "Replace", "pattern": {"String": " "}, "content": "_"}]})) == 4
    assert max_chars_per_token(variant(normalizer={"type": "Strip", "strip_left": True, "strip_right": True})) is None
    assert max_chars_per_token(variant(pre_tokenizer={"type": "Whitespace"})) is None
    assert max_chars_per_token(object()) is None  # not a fast tokenizer


# -- the field table and docs/requests.md ------------------------------------------------------------

REQUESTS_DOC = __import__("pathlib").Path(__file__).resolve().parent.parent / "docs" / "requests.md"


def _doc_row(f) -> str:
    """``docs/requests.md``'s row for field ``f`` of ``validation_fields.FIELDS``."""
    import json

    from splitserve.validation_fields import ABSENT, ANY_BOOL, USED
    where = ["✓" if p in f.places else "" for p in ("completions", "chat")]
    where.append("✓" if "generate" in f.places else "`sampling_params`" if "sampling_params" in f.places else "")
    if f.noop is USED:
        rule = f.rule
    elif f.noop is ABSENT:
        rule = "not implemented: refused unless absent or null"
    elif f.noop is ANY_BOOL:
        rule = "any boolean; no effect"
    else:
        rule = f"not implemented: refused unless `{json.dumps(f.noop)}` (or null)"
    goes = ", ".join(f"`{g}`" for g in f.goes)
    return f"| `{f.name}` | {' | '.join(where)} | {rule} | {goes} |"


def test_the_docs_table_of_request_fields_is_the_validation_table():
    """Every row of docs/requests.md's field table is the row the field table makes, in its order:
    names, the endpoints that take each, its rule and where its value goes."""
    from splitserve.validation_fields import FIELDS, GENERATION_PLACES
    expected = [_doc_row(f) for f in FIELDS if set(f.places) & set(GENERATION_PLACES)]
    rows = [line for line in REQUESTS_DOC.read_text().splitlines() if line.startswith("| `")]
    missing = [r for r in expected if r not in rows]
    assert rows == expected, "docs/requests.md's table differs from validation_fields.FIELDS; write:\n" + \
        "\n".join(missing or expected)


def test_the_field_table_names_real_destinations_and_places():
    """Each field's destination is an attribute of ValidatedRequest or SamplingParams, each place one
    of the four, and the known-field sets are the table's."""
    import dataclasses

    from splitserve.engine.io import SamplingParams
    from splitserve.validation import ValidatedRequest
    from splitserve.validation_fields import FIELDS, KNOWN, PLACES
    attrs = {cls.__name__: {f.name for f in dataclasses.fields(cls)} for cls in (ValidatedRequest, SamplingParams)}
    for f in FIELDS:
        assert set(f.places) <= set(PLACES) and f.places, f.name
        for goes in f.goes:
            cls, attr = goes.split(".")
            assert attr in attrs[cls], f"{f.name} goes to {goes}, which does not exist"
    assert len({f.name for f in FIELDS}) == len(FIELDS), "a field named twice"
    assert KNOWN["chat"] >= {"messages", "tools"} and "prompt" not in KNOWN["chat"]
    assert KNOWN["tokenize"] == {"model", "prompt", "messages", "tools", "add_special_tokens",
                                 "add_generation_prompt", "return_token_strs"}
    assert KNOWN["detokenize"] == {"model", "tokens"}


def test_the_field_tables_rules_name_the_codes_bounds():
    """The numbers a rule in the field table states are the constants validation enforces."""
    from splitserve.engine.grammar import MAX_TOOLS
    from splitserve.engine.io import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
    from splitserve.validation import MAX_N, MAX_OPENAI_STOP, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS
    from splitserve.validation_fields import FIELDS
    rule = {f.name: f.rule for f in FIELDS}
    assert f"at most {MAX_OPENAI_STOP} ({MAX_STOP} on `/generate`)" in rule["stop"]
    assert f"at most {MAX_STOP_CHARS} characters" in rule["stop"]
    assert f"at most {MAX_STOP_TOKEN_IDS} token ids" in rule["stop_token_ids"]
    assert f"[1, {MAX_N}]" in rule["n"]
    assert f"at most {MAX_LOGIT_BIAS} tokens" in rule["logit_bias"]
    assert all(f"[0, {MAX_TOP_LOGPROBS}]" in rule[k] for k in ("logprobs", "top_logprobs", "top_logprobs_num"))
    assert f"at most {MAX_TOOLS} functions" in rule["tools"]
    assert f"absent: {DEFAULT_MAX_TOKENS}" in rule["max_tokens"]
