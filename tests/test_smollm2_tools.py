"""The demo model's tool-capable chat template (``splitserve/models/smollm2_chat.py``).

Checked everyday: SmolLM2's own template (read from the wheel's GGUF file) is the one the module
recognizes; without tools, calls or tool results the tool-capable template renders it byte for
byte on many message lists; with tools it renders them in Hermes' format, an assistant's calls as
the parser reads them, tool results as ``<tool_response>``s; a worker picks it for SmolLM2's own
template only. ``long``: a SmolLM2 server answers ``tool_choice`` required with a call whose
arguments validate (colocated and split), a ``--chat-template`` that renders no tools is still a
400, and the README's agent example runs against it.
"""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest

from splitserve.models.smollm2_chat import SMOLLM2_TEMPLATE, SMOLLM2_TOOLS_TEMPLATE, tool_template
from splitserve.server.tool_calls import parse
from splitserve.validation import renders_tools

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def render(template: str, messages: list, tools=None, add_generation_prompt: bool = True) -> str:
    """What ``apply_chat_template(..., tokenize=False)`` renders (transformers' own renderer)."""
    return render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                 add_generation_prompt=add_generation_prompt)[0][0]


class TemplateOnly:
    """A tokenizer as far as ``validation.renders_tools`` asks: a template and its rendering."""

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False, **kw):
        return render(self.chat_template, messages, tools, add_generation_prompt)


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar types


def gguf_string(path: Path, key: str) -> str:
    """The string value ``key`` of a GGUF file's metadata, read without its tensors (a fraction of a
    second, where ``gguf.GGUFReader`` takes seconds on this file)."""
    with open(path, "rb") as f:
        def num(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(kind: int) -> None:
            if kind == 8:  # a string
                f.seek(num("Q"), 1)
            elif kind == 9:  # an array
                of, n = num("I"), num("Q")
                if of in _SIZES:
                    f.seek(_SIZES[of] * n, 1)
                else:
                    for _ in range(n):
                        skip(of)
            else:
                f.seek(_SIZES[kind], 1)

        assert f.read(4) == b"GGUF"
        num("I"), num("Q")  # version, tensors
        for _ in range(num("Q")):
            name, kind = f.read(num("Q")).decode(), num("I")
            if name == key and kind == 8:
                return f.read(num("Q")).decode()
            skip(kind)
    raise KeyError(key)


TEXTS = ["", "Hi", "What is the capital of France?", "line one\nline two\n", "  spaced  ", "naïve café ✓ 東京",
         "{{ not jinja }} {% raw %}", "<|im_end|> inside", "quotes \" and ' and \\ backslash", "\t\n",
         "<tool_call>\n{\"name\": \"x\"}\n</tool_call>", "# Tools"]


def message_lists(seed: int, count: int) -> list[list[dict]]:
    """Conversations of system, user and assistant turns in many shapes: with and without a
    system turn, roles repeated or alternating, one to seven turns, odd contents."""
    rng = random.Random(seed)
    lists = []
    for _ in range(count):
        turns = []
        if rng.random() < 0.5:
            turns.append({"role": "system", "content": rng.choice(TEXTS)})
        for i in range(rng.randint(1, 6)):
            role = rng.choice(["user", "assistant"]) if rng.random() < 0.2 else ("user", "assistant")[i % 2]
            turns.append({"role": role, "content": rng.choice(TEXTS)})
        if rng.random() < 0.1:
            turns.append({"role": "system", "content": rng.choice(TEXTS)})  # a late system turn
        lists.append(turns)
    return lists


def test_the_template_recognized_is_smollm2s_own_as_its_file_carries_it():
    from splitserve.models.resolve import smollm2_gguf

    try:
        path = smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert gguf_string(path, "tokenizer.chat_template") == SMOLLM2_TEMPLATE


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_it_renders_smollm2s_own_byte_for_byte(generation_prompt):
    for messages in message_lists(seed=33, count=300):
        own = render(SMOLLM2_TEMPLATE, messages, add_generation_prompt=generation_prompt)
        assert render(SMOLLM2_TOOLS_TEMPLATE, messages, add_generation_prompt=generation_prompt) == own, messages
        # tools=None and tools=[] are "no tools" too (tool_choice none renders none)
        assert render(SMOLLM2_TOOLS_TEMPLATE, messages, [], generation_prompt) == own


def test_with_tools_it_renders_them_in_hermes_format_and_the_parser_reads_its_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                     {"role": "tool", "tool_call_id": "call_2", "content": "21 C"}]
    text = render(SMOLLM2_TOOLS_TEMPLATE, history, [WEATHER])
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in system
    written = re.search(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, re.S).group(1)
    assert written == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse(written, ["get_weather"]).message()["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n21 C\n" \
           "</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    # the client's system turn replaces SmolLM2's default one, and is written once
    own_system = render(SMOLLM2_TOOLS_TEMPLATE, [{"role": "system", "content": "Be brief."}] + ASK, [WEATHER])
    assert own_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and own_system.count("Be brief.") == 1
    assert "SmolLM" not in own_system


def test_a_worker_serves_smollm2s_own_template_with_tools_and_no_other_changed():
    assert renders_tools(TemplateOnly(SMOLLM2_TOOLS_TEMPLATE)) and not renders_tools(TemplateOnly(SMOLLM2_TEMPLATE))
    assert tool_template(SMOLLM2_TEMPLATE) == SMOLLM2_TOOLS_TEMPLATE
    assert tool_template(SMOLLM2_TEMPLATE + "\n") == SMOLLM2_TOOLS_TEMPLATE  # a file's trailing newline
    from splitserve.testing.tiny import CHAT_TEMPLATE

    assert tool_template(CHAT_TEMPLATE) is None and tool_template(None) is None
    assert tool_template({"default": SMOLLM2_TEMPLATE}) is None  # named templates: left alone


# -- the real model (long) --------------------------------------------------------------------------


def readme_agent_example() -> str:
    """The README's agent example: the python block after its ``agent-example`` marker."""
    text = README.read_text()
    at = text.index("<!-- agent-example")
    return re.search(r"```python\n(.*?)```", text[at:], re.S).group(1)


def _valid_weather_call(call) -> dict:
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 20, args
    return args


@pytest.mark.long
def test_smollm2_calls_validly_when_required_and_the_readme_agent_runs(monkeypatch, tmp_path, capsys):
    """SmolLM2 with the template it is served with by default: ``required`` makes a call whose
    arguments validate, colocated and split; the README's agent example runs the round trip; a
    ``--chat-template`` of SmolLM2's own (no tools) is a 400 naming ``tools``."""
    import requests
    from conftest import ServerProcess, free_port

    from tests.cluster import Cluster

    openai = pytest.importorskip("openai")
    own = tmp_path / "smollm2_own.jinja"
    own.write_text(SMOLLM2_TEMPLATE)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    small_pool = ("--max-total-tokens", "4096")
    plain = ServerProcess(*small_pool, "--chat-template", str(own), model="smollm2")
    plain._spawn(free_port())
    try:
        with Cluster(1, 1, "nixl", model="smollm2", worker_args=small_pool) as split:
            plain.wait_ready()
            r = requests.post(plain.url + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]},
                              timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
            for url in (split.url, split.decode[0].url):  # through the router, and decode alone
                client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
                first = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER],
                                                       tool_choice="required", temperature=0, max_tokens=200)
                assert first.choices[0].finish_reason == "tool_calls"
                calls = first.choices[0].message.tool_calls
                print(f"\nsmollm2 at {url}: " + "; ".join(f"{c.function.name}({c.function.arguments})" for c in calls))
                assert calls and all(_valid_weather_call(c) for c in calls)
            code = readme_agent_example().replace("http://127.0.0.1:8000", split.url)
            exec(compile(code, "README.md agent example", "exec"), {"__name__": "readme_agent_example"})
            out = capsys.readouterr().out
            with capsys.disabled():
                print("\n" + out)
            assert re.search(r"^call: get_weather \{.*\}$", out, re.M) and re.search(r"^answer: \S", out, re.M)
            split.assert_no_leaks()
    finally:
        plain.stop()
