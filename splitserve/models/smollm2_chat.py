"""SmolLM2's chat template with tools: the demo model's own template, and the same ChatML with
tools rendered in Hermes' format (``docs/tools.md``) that a checkpoint carrying SmolLM2's own is
served with (``tool_template``).

SmolLM2-Instruct's own template renders no tools, so a request with ``tools`` would be refused.
:data:`SMOLLM2_TOOLS_TEMPLATE` renders what SmolLM2's own renders, byte for byte, for every
conversation without tools, calls or tool results (so prefix caches and benchmarks see the same
tokens); given tools it writes them as Qwen2.5's template does: the functions as JSON in the
system turn (the client's system message, else SmolLM2's default one) with the format's
instructions, an assistant's calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
(what ``server/tool_calls.py`` parses), tool results as a user turn of ``<tool_response>``s. Calls
and tool results are written so also without tools (SmolLM2's own drops the calls).
"""

from __future__ import annotations

from typing import Optional

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2-Instruct's own template, as its GGUF file and Hugging Face checkpoint carry it (what
:func:`tool_template` recognizes; ``tests/test_smollm2_tools.py`` reads it from the file)."""

SMOLLM2_TOOLS_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}{{ '" + SMOLLM2_DEFAULT_SYSTEM + "' }}{% endif %}"
    "{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not tools and loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's ChatML with tools in Hermes' format (module docstring)."""


def tool_template(own: Optional[str]) -> Optional[str]:
    """The template to serve a checkpoint whose own chat template is ``own`` with, when we ship a
    tool-capable one for it (SmolLM2's: :data:`SMOLLM2_TOOLS_TEMPLATE`); else None."""
    if isinstance(own, str) and own.strip() == SMOLLM2_TEMPLATE:
        return SMOLLM2_TOOLS_TEMPLATE
    return None
