"""The official ``openai`` client against a real ``splitserve serve --model tiny`` (the shared
session server): completions and chat, with and without streaming, usage that matches the
tokenizer (prompt) and the generated tokens (completion), and the client's exception classes for
our error statuses."""

from __future__ import annotations

import pytest
import requests

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    path = requests.get(server.url + "/get_model_info", timeout=10).json()["tokenizer_path"]
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def generated_ids(server, prompt_ids: list[int], n: int) -> list[int]:
    """The same greedy continuation through SGLang's /generate, which returns the token ids."""
    r = requests.post(server.url + "/generate", json={"input_ids": prompt_ids, "sampling_params": {
        "max_new_tokens": n, "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_models_list(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_completion(client, model, tokenizer, server):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    prompt_ids = tokenizer.encode(PROMPT)
    assert out.usage.prompt_tokens == len(prompt_ids)
    ids = generated_ids(server, prompt_ids, 12)
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.total_tokens == len(prompt_ids) + len(ids)
    assert out.choices[0].text == tokenizer.decode(ids)
    assert out.choices[0].finish_reason in ("stop", "length") and out.model == model


def test_completion_streaming(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat(client, model, tokenizer, server):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    assert out.usage.prompt_tokens == len(prompt_ids)
    ids = generated_ids(server, list(prompt_ids), 10)
    assert out.usage.completion_tokens == len(ids)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == tokenizer.decode(ids)


def test_chat_streaming(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_ignore_eos_and_seed_through_extra_body(client, model):
    a = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True, "top_k": 50})
    b = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True, "top_k": 50})
    assert a.usage.completion_tokens == 8 and a.choices[0].finish_reason == "length"
    assert a.choices[0].text == b.choices[0].text  # same seed, same sample


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"),
    ({"n": 17}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
])
def test_bad_request_raises_bad_request_error(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and param in info.value.body["message"]


def test_chat_with_a_tool_choice_not_among_tools_is_refused(client, model):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError, match="not among tools"):
        client.chat.completions.create(model=model, messages=MESSAGES, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "g"}})


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nothing", prompt=PROMPT, max_tokens=2)
