"""Structured outputs: a grammar that masks the logits of every token a request samples.

A request's ``response_format`` (``{"type": "json_object"}``, or ``{"type": "json_schema",
"json_schema": {"schema": ...}}``) is checked at the edge (:func:`parse_response_format`: its
shape, its size, its depth, how many regexes it intersects) into a :class:`GrammarSpec`, then
compiled for this worker's tokenizer by ``engine/grammar_compiler.py`` off the engine loop and
off the tokenize lanes; a schema it cannot compile is refused with the engine's own words before
the request reaches the engine.

The engine gives each sequence its own :class:`GrammarState` (a copy of its request's own
matcher), masks the sequence's logits row with it before sampling (greedy or not) and
advances it with the sampled token. The state is a function of the tokens generated so far, so it
is never carried between workers: prefill samples the first token under the mask; decode builds a
fresh state and replays the first token into it (a first token the grammar refuses is a transfer
error); a decode that recomputes a lost prefill's prompt starts from a fresh state, like a
preempted sequence keeps its own (its tokens are kept). See ``docs/structured_outputs.md``.

Engine: llguidance (pinned in pyproject.toml; why it, not xgrammar, is in that doc).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from splitserve.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAX_SCHEMA_BYTES = 64 << 10
"""The largest schema (as compact JSON) a request may give: far above any real tool or output
schema, far below what would make its compilation or its cache costly."""
MAX_SCHEMA_DEPTH = 32
"""How deeply a schema's objects and arrays may nest (checked before anything recurses into it)."""
MAX_INTERSECTED_PATTERNS = 8
"""How many regexes (``pattern``, ``patternProperties``) one join of a schema may intersect: the
grammar engine intersects the patterns that ``allOf``, a ``$ref`` beside a constraint or an
``anyOf`` beside one join on one value, in time exponential in their number (20 joined patterns of
20 bytes each took a second, 22 four, whichever form joins them, and no fuel limit of the engine
bounds it), so the count is bounded before anything compiles."""

# The JSON a random model could pad without end is kept tight: no free whitespace between tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asked for: ``kind`` ``"json_object"`` or ``"json_schema"``, and the schema as
    compact JSON in the client's key order (the cache key); or ``"regex"`` and the regex; or
    ``"lark"`` and a grammar in llguidance's Lark (a forced tool call: :func:`tool_call_spec`)."""

    kind: str
    schema: str


def _depth_ok(value: Any, limit: int) -> bool:
    """Whether ``value`` nests no deeper than ``limit``, without recursion (a hostile depth cannot
    blow the stack)."""
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return True


_NOT_CONSTRAINTS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                              "writeOnly", "$id", "$schema", "$anchor", "$defs", "definitions"})
"""Keys beside a ``$ref`` or an ``anyOf`` that constrain nothing, so join nothing to it."""


def _joins(v: dict) -> bool:
    """Whether the schema object ``v`` makes the grammar engine intersect subschemas on one value:
    ``allOf``; a ``$ref`` beside a constraint (the target and the constraint both hold); an
    ``anyOf``/``oneOf`` beside a constraint (each choice is joined with it)."""
    if "allOf" in v:
        return True
    rest = set(v) - _NOT_CONSTRAINTS
    if isinstance(v.get("$ref"), str) and rest - {"$ref"}:
        return True
    return ("anyOf" in v or "oneOf" in v) and bool(rest - {"anyOf", "oneOf"})


def _own_patterns(v: dict) -> int:
    props = v.get("patternProperties")
    return isinstance(v.get("pattern"), str) + (len(props) if isinstance(props, dict) else 0)


def _joined_patterns(schema: Any) -> int:
    """The most regexes (``pattern`` values, ``patternProperties`` keys) one join of ``schema``
    (see :func:`_joins`) can intersect: those inside the joining object, or every regex of the
    schema where a ``$ref`` inside it could reach any of them. An overestimate, never under; 0
    without a join. Without recursion (the depth is checked first)."""
    below: dict[int, tuple[int, bool]] = {}  # id(node) -> (regexes inside it, whether it holds a $ref)
    most, every, stack = 0, False, [(schema, False)]
    while stack:
        v, done = stack.pop()
        kids = [k for k in (v.values() if isinstance(v, dict) else v) if isinstance(k, (dict, list))]
        if not done:
            stack.append((v, True))
            stack.extend((k, False) for k in kids)
            continue
        inside = [below[id(k)] for k in kids]
        count, refs = sum(c for c, _ in inside), any(r for _, r in inside)
        if isinstance(v, dict):
            count, refs = count + _own_patterns(v), refs or isinstance(v.get("$ref"), str)
            if _joins(v):
                most, every = max(most, count), every or refs
        below[id(v)] = (count, refs)
    return below[id(schema)][0] if every else most


def limit_message(error: str) -> str:
    """The grammar engine's error, its first line only (what failed, the limit it hit), at most 300
    characters: never its state dump, and no more of the client's own grammar than a line."""
    first = next((line.strip() for line in error.splitlines() if line.strip()), "an unknown error")
    return first if len(first) <= 300 else first[:297] + "..."


def parse_response_format(v: Any, param: str = "response_format") -> Optional[GrammarSpec]:
    """The grammar a ``response_format`` asks for; None for ``{"type": "text"}`` or absent.
    Raises InvalidRequest naming the field for anything malformed or too large."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise InvalidRequest(f"{param} must be an object", param)
    kind = v.get("type")
    if kind == "text":
        extra = set(v) - {"type"}
        if extra:
            raise InvalidRequest(f"unrecognized field `{param}.{sorted(extra)[0]}`", param)
        return None
    if kind == "json_object":
        extra = set(v) - {"type"}
        if extra:
            raise InvalidRequest(f"unrecognized field `{param}.{sorted(extra)[0]}`", param)
        return GrammarSpec("json_object", '{"type":"object"}')
    if kind != "json_schema":
        raise InvalidRequest(f"{param}.type must be one of text, json_object, json_schema; got "
                             f"{json.dumps(kind)[:64]}", f"{param}.type")
    extra = set(v) - {"type", "json_schema"}
    if extra:
        raise InvalidRequest(f"unrecognized field `{param}.{sorted(extra)[0]}`", param)
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise InvalidRequest(f"{param}.json_schema must be an object", f"{param}.json_schema")
    extra = set(js) - {"name", "description", "schema", "strict"}
    if extra:
        raise InvalidRequest(f"unrecognized field `{param}.json_schema.{sorted(extra)[0]}`", f"{param}.json_schema")
    name = js.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > 64):
        raise InvalidRequest(f"{param}.json_schema.name must be a string of at most 64 characters",
                             f"{param}.json_schema.name")
    if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
        raise InvalidRequest(f"{param}.json_schema.strict must be a boolean", f"{param}.json_schema.strict")
    return schema_spec(js.get("schema", {}), f"{param}.json_schema.schema")


MAX_REGEX_CHARS = 4096
"""The longest ``regex`` SGLang's ``/generate`` may constrain an answer with."""


def sglang_spec(sampling_params: dict, prefix: str = "sampling_params.") -> Optional[GrammarSpec]:
    """SGLang's ``/generate`` constraints: ``json_schema`` (a schema as a JSON string) or
    ``regex``; None when neither. ``ebnf`` stays refused by the caller."""
    schema, regex = sampling_params.get("json_schema"), sampling_params.get("regex")
    if schema is not None and regex is not None:
        raise InvalidRequest("give json_schema or regex, not both", prefix + "regex")
    if schema is not None:
        if not isinstance(schema, str):
            raise InvalidRequest(f"{prefix}json_schema must be a string (a JSON schema as JSON)", prefix + "json_schema")
        if len(schema) > MAX_SCHEMA_BYTES:
            raise InvalidRequest(f"{prefix}json_schema is longer than {MAX_SCHEMA_BYTES} characters",
                                 prefix + "json_schema")
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"{prefix}json_schema is not JSON: {exc}", prefix + "json_schema") from None
        return schema_spec(parsed, prefix + "json_schema")
    if regex is not None:
        if not isinstance(regex, str) or not regex or len(regex) > MAX_REGEX_CHARS:
            raise InvalidRequest(f"{prefix}regex must be a non-empty string of at most {MAX_REGEX_CHARS} characters",
                                 prefix + "regex")
        return GrammarSpec("regex", regex)
    return None


def schema_spec(schema: Any, param: str) -> GrammarSpec:
    """A JSON schema (a dict, or ``true``) as a :class:`GrammarSpec`, within the size and depth caps."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON schema object", param)
    if not _depth_ok(schema, MAX_SCHEMA_DEPTH):
        raise InvalidRequest(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
    joined = _joined_patterns(schema)
    if joined > MAX_INTERSECTED_PATTERNS:
        raise InvalidRequest(f"{param} joins {joined} regexes (pattern, patternProperties) on one value (allOf, or "
                             "$ref or anyOf beside other keywords), which intersects them; at most "
                             f"{MAX_INTERSECTED_PATTERNS} are accepted", param)
    # keys keep the client's order: the order of "properties" is the order the answer's keys come in
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"{param} is {len(text.encode())} bytes as JSON; at most {MAX_SCHEMA_BYTES} are "
                             "accepted", param)
    return GrammarSpec("json_schema", text)


class GrammarError(ValueError):
    """The grammar refused a token or failed (a resource limit: its message names it); the request
    fails alone, as a bad request (the grammar is the client's)."""


class GrammarState:
    """One sequence's place in its grammar. Engine loop only."""

    def __init__(self, matcher, vocab_size: int, lltok=None, added: tuple = ()):
        self._m = matcher
        self.vocab_size = vocab_size
        self._lltok, self._added = lltok, added  # the tokenizer's added tokens' ids (see allowed)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as a bool array [vocab_size]."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        if self._m.is_error():
            raise GrammarError(f"the grammar failed: {limit_message(self._m.get_error())}")
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].view(bool)
        for token in self._added:
            if allowed[token] and self._m.validate_tokens([token]) == 0:
                self._spell(allowed, token)
        return allowed

    def _spell(self, allowed: np.ndarray, token: int) -> None:
        """Where the grammar forces text an added token spells (``"<tool_call>"`` inside a JSON
        string), the grammar engine's mask offers the added token, which it then refuses: offer
        the text's first ordinary token instead (its first byte's, where the tokenizer reads the
        text as the added token)."""
        allowed[token] = False
        forced = self._m.compute_ff_bytes()
        if not forced or self._lltok is None:
            return
        for text in (forced, forced[:1]):
            first = self._lltok.tokenize_bytes(text)[:1]
            if first and first[0] not in self._added and first[0] < allowed.size \
                    and self._m.validate_tokens(first) == 1:
                allowed[first[0]] = True
                return

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] with every token the grammar forbids at ``-inf`` (a new tensor)."""
        import torch  # here, not at the top: the router validates grammars and must not load torch

        allowed = self.allowed()
        if allowed.size < logits.numel():  # logit rows beyond the tokenizer's tokens: never allowed
            allowed = np.concatenate([allowed, np.zeros(logits.numel() - allowed.size, dtype=bool)])
        x = logits.detach().cpu()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        # in numpy, not torch: torch.where and masked_fill over SmolLM2's 49,152 logits took 20-70 ms
        # on a busy 2-core machine (its intra-op threads contend), numpy's where 0.03 ms
        return torch.from_numpy(np.where(allowed, x.numpy(), x.new_tensor(float("-inf")).numpy()))

    def advance(self, token: int) -> None:
        """Take ``token``; raises GrammarError when the grammar does not allow it."""
        if not self._m.consume_token(token):
            raise GrammarError(f"the grammar does not allow token {token} here: {limit_message(self._m.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more: the request stops here."""
        return self._m.is_stopped()


# -- tool calls ------------------------------------------------------------------------------------

MAX_TOOLS = 128
"""Functions one request may offer (OpenAI's own cap)."""
MAX_TOOL_DESCRIPTION_CHARS = 8192
"""Characters of one function's description (it is rendered into the prompt)."""
MAX_PARALLEL_TOOL_CALLS = 8
"""Calls one forced answer (``tool_choice`` required with ``parallel_tool_calls``) may hold: the
grammar ends the answer after so many, so a model that never chooses to stop (the random tiny
one) still ends with whole calls rather than at ``max_tokens``."""
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The Hermes / Qwen2.5 tool-call format the tiny models' template asks for and the server parses:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolsSpec:
    """A request's ``tools`` and ``tool_choice``: ``tools`` as the chat template gets them
    (OpenAI's shape), ``choice`` ``"auto"``, ``"none"``, ``"required"`` or the one function's
    name; ``parallel``: ``parallel_tool_calls`` (default true); ``grammar``: the
    :class:`GrammarSpec` that forces a call (``required``, a named function), else None."""

    tools: tuple
    choice: str
    parallel: bool = True
    grammar: Optional[GrammarSpec] = None

    @property
    def names(self) -> frozenset:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def parses(self) -> bool:
        """Whether the answer's tool-call text is parsed into ``tool_calls`` (not with ``none``)."""
        return self.choice != "none"


def parse_tools(tools: Any, choice: Any, parallel: Any) -> Optional[ToolsSpec]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, checked (shapes,
    a cap of :data:`MAX_TOOLS`, each ``parameters`` within the schema bounds, and all the tools
    together too, since the grammar of ``required`` joins them), or None when no tools are given.
    Raises InvalidRequest naming the field."""
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be an array of {\"type\": \"function\", \"function\": {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools takes at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f"{p} must be {{\"type\": \"function\", \"function\": {{...}}}}", p)
        extra = set(tool) - {"type", "function"}
        if extra:
            raise InvalidRequest(f"unrecognized field `{p}.{sorted(extra)[0]}`", p)
        fn = tool["function"]
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise InvalidRequest(f"unrecognized field `{p}.function.{sorted(extra)[0]}`", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise InvalidRequest(f"{p}.function.name must be 1 to 64 letters, digits, _ or -", f"{p}.function.name")
        if name in names:
            raise InvalidRequest(f"{p}.function.name `{name}` is given twice", f"{p}.function.name")
        names.add(name)
        desc = fn.get("description")
        if desc is not None and (not isinstance(desc, str) or len(desc) > MAX_TOOL_DESCRIPTION_CHARS):
            raise InvalidRequest(f"{p}.function.description must be a string of at most "
                                 f"{MAX_TOOL_DESCRIPTION_CHARS} characters", f"{p}.function.description")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise InvalidRequest(f"{p}.function.strict must be a boolean", f"{p}.function.strict")
        params = fn.get("parameters")
        params = _NO_PARAMETERS if params is None else json.loads(schema_spec(params, f"{p}.function.parameters").schema)
        entry = {"name": name}
        if desc is not None:
            entry["description"] = desc
        entry["parameters"] = params
        out.append({"type": "function", "function": entry})
    total = len(json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode())
    if total > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"tools are {total} bytes as JSON; at most {MAX_SCHEMA_BYTES} are accepted", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or set(choice) - {"type", "function"} \
                or set(fn) - {"name"} or not isinstance(fn.get("name"), str):
            raise InvalidRequest("tool_choice must be none, auto, required or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if fn["name"] not in names:
            raise InvalidRequest(f"tool_choice names the function `{fn['name'][:64]}`, which is not among tools",
                                 "tool_choice")
        choice = fn["name"]
        forced = [t for t in out if t["function"]["name"] == choice]
        return ToolsSpec(tuple(out), choice, parallel is not False, tool_call_spec(forced, many=False))
    if choice not in ("none", "auto", "required"):
        raise InvalidRequest("tool_choice must be none, auto, required or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    grammar = tool_call_spec(out, many=parallel is not False) if choice == "required" else None
    return ToolsSpec(tuple(out), choice, parallel is not False, grammar)


def tag_tokens(lark: str, lltok) -> str:
    """``lark`` (a grammar of :func:`tool_call_spec`) with its quoted tool-call tags written as
    the tokenizer's added tokens where each tag is one (``<tool_call>``): llguidance matches added
    tokens only by such references, never by their text, so a quoted tag would have to be spelled
    in ordinary tokens the model lacks. Only the tags around the call are rewritten: the same text
    quoted inside a function's parameters schema is the client's, a JSON string, and stays one."""
    head, sep, tail = lark.rpartition("\ncall: ")
    if not sep:
        return lark
    opening, closing = json.dumps(TOOL_CALL_OPEN), json.dumps(TOOL_CALL_CLOSE)
    if not (tail.startswith(opening + " ") and tail.endswith(" " + closing + "\n")):
        return lark
    body = tail[len(opening):-len(closing) - 1]

    def written(tag: str, quoted: str) -> str:
        ids = lltok.tokenize_str(tag)
        return tag if len(ids) == 1 and lltok.is_special_token(ids[0]) else quoted

    return head + sep + written(TOOL_CALL_OPEN, opening) + body + written(TOOL_CALL_CLOSE, closing) + "\n"


def tool_call_spec(tools: list, many: bool) -> GrammarSpec:
    """The grammar (Lark, llguidance's dialect) of an answer that is one tool call of one of
    ``tools`` (``many``: one to :data:`MAX_PARALLEL_TOOL_CALLS`, one per line): ``<tool_call>\\n{"name":
    <one of the names>, "arguments": <that function's parameters>}\\n</tool_call>``, its JSON compact.
    Raises InvalidRequest when the combined schema joins too many regexes on one value."""
    schema = {"x-guidance": dict(JSON_OPTIONS), "anyOf": [
        {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                          "arguments": t["function"]["parameters"]},
         "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    # one tool's $ref resolves against this combined schema, so it may join other tools' patterns
    joined = _joined_patterns({"anyOf": schema["anyOf"]})  # x-guidance is an option, not a constraint
    if joined > MAX_INTERSECTED_PATTERNS:
        raise InvalidRequest(f"tools join {joined} regexes (pattern, patternProperties) on one value across "
                             f"the functions' parameters (a $ref into another function's); at most "
                             f"{MAX_INTERSECTED_PATTERNS} are accepted", "tools")
    call = json.dumps(TOOL_CALL_OPEN) + ' "\\n" %json ' + json.dumps(schema, separators=(",", ":"),
                                                                      ensure_ascii=False) + \
        ' "\\n" ' + json.dumps(TOOL_CALL_CLOSE)
    start = f'start: call ("\\n" call){{0,{MAX_PARALLEL_TOOL_CALLS - 1}}}\n' if many else "start: call\n"
    return GrammarSpec("lark", start + "call: " + call + "\n")
