"""``/tokenize`` and ``/detokenize`` (vLLM's shape) on a worker and through the router: the tokens
are the model's tokenizer's own (a prompt with its special tokens, messages as the chat template
renders them for ``/v1/chat/completions``), detokenize gives the text back, and bad or oversized
input is a 4xx naming its field. Servers: the session's tiny-model worker and split cluster."""

from __future__ import annotations

import pytest
import requests

TEXT = "The capital of France is Paris."
MESSAGES = [{"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "colour_of", "description": "The colour of a thing.",
                                           "parameters": {"type": "object", "properties": {"thing": {"type": "string"}},
                                                          "required": ["thing"]}}}]


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    path = requests.get(server.url + "/get_model_info", timeout=10).json()["tokenizer_path"]
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = requests.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


@pytest.mark.parametrize("where", ["worker", "router"])
def test_tokenize_and_detokenize(server, pd_cluster, tokenizer, where):
    url = server.url if where == "worker" else pd_cluster.url
    info = requests.get(server.url + "/get_model_info", timeout=10).json()
    got = _post(url, "/tokenize", {"model": "tiny", "prompt": TEXT})
    assert got == {"count": len(tokenizer.encode(TEXT)), "max_model_len": info["max_context"],
                   "tokens": tokenizer.encode(TEXT)}
    bare = _post(url, "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    assert bare["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    assert _post(url, "/detokenize", {"model": "tiny", "tokens": bare["tokens"]}) == {"prompt": TEXT}
    chat = _post(url, "/tokenize", {"messages": MESSAGES})
    assert chat["tokens"] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    # what /v1/chat/completions counts as its prompt
    answer = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert answer["usage"]["prompt_tokens"] == chat["count"]
    no_gen = _post(url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert no_gen["count"] < chat["count"] and chat["tokens"][:no_gen["count"]] == no_gen["tokens"]
    # with tools: rendered by the template, as a chat request with them counts its prompt
    with_tools = _post(url, "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
    assert with_tools["count"] > chat["count"] and "colour_of" in tokenizer.decode(with_tools["tokens"])
    answer = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1})
    assert answer["usage"]["prompt_tokens"] == with_tools["count"]


@pytest.mark.parametrize("path,body,param,status", [
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt", 400),
    ("/tokenize", {"prompt": ["x"]}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate", 400),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", 400),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", 400),
    ("/tokenize", {"prompt": "x", "tools": TOOLS}, "tools", 400),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]", 400),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", 400),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model", 404),
    ("/tokenize", {"prompt": "a" * 2_000_000}, "prompt", 400),  # cannot fit the context: refused by length
    ("/detokenize", {}, "tokens", 400),
    ("/detokenize", {"tokens": [1, 2048]}, "tokens", 400),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", 400),
    ("/detokenize", {"tokens": [1, True]}, "tokens", 400),
    ("/detokenize", {"tokens": "1 2"}, "tokens", 400),
    ("/detokenize", {"tokens": [1] * 100_000}, "tokens", 400),  # more ids than the context holds
])
def test_bad_input_is_a_4xx_naming_its_field(server, path, body, param, status):
    got = _post(server.url, path, body, status)
    assert got["error"]["param"] == param, got
    r = requests.post(server.url + path, data=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"]
