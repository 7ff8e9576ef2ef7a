"""Request validation: one function, :func:`validate_request`, for every endpoint and every process.

The worker calls it with its tokenizer and model limits and gets token ids back; the router calls
it without a tokenizer (checks of types, ranges and fields only) before it picks workers. Both
therefore refuse the same requests with the same messages: an :class:`InvalidRequest` (400; 404
for another ``model``) whose ``param`` names the offending field. The fields each endpoint takes
and each one's rule are ``validation_fields.FIELDS``; ``docs/requests.md`` writes them out, with
the rules that join fields.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from splitserve.engine.continuation import parse_continuation
from splitserve.engine.detokenizer import stop_matcher
from splitserve.engine.grammar import MAX_TOOLS, parse_response_format, parse_tools, sglang_spec
from splitserve.engine.io import (
    DEFAULT_MAX_TOKENS, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, Bootstrap, GenerateRequest, InvalidRequest, SamplingParams,
)
from splitserve.hosts import check_host
from splitserve.outcomes import Reason
from splitserve.validation_fields import ABSENT, ANY_BOOL, KNOWN, NOOP

ENDPOINTS = ("completions", "chat", "generate")
# Caps on one request's stop conditions, on every route (docs/security.md, "One request's input"):
# with them, matching stop strings costs a bounded amount per generated token and holds a bounded
# automaton (engine/detokenizer.py), whatever a client sends.
MAX_OPENAI_STOP = 4  # stop strings on /v1/completions and /v1/chat/completions (the OpenAI API's own cap)
MAX_STOP = 16  # stop strings on /generate
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids, every route
MAX_N = 16  # choices of one request (n): each is a sequence of its own
MAX_SEED = 2**63
MAX_ROOM = 2**63
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

_ABSENT = ABSENT  # a field not in the body (where None would be a client's null)


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed :func:`validate_request`, in the engine's terms."""

    endpoint: str  # "completions" | "chat" | "generate"
    sampling: SamplingParams
    model: Optional[str] = None  # the name the client asked for; None if it named none
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    prompt_ids: Optional[tuple[int, ...]] = None  # None: text prompt and no tokenizer given
    prompt_text: Optional[str] = None  # completions / generate text prompt
    messages: Optional[tuple[dict, ...]] = None  # chat: [{"role", "content": str}], roles normalised
    max_tokens_set: bool = False  # the client named max_tokens (else it is the default)
    rid: Optional[str] = None
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    cache_salt: str = ""
    stream_ids: bool = False  # the router's: each event's token ids in a comment line (server/generation.py)
    continuation: Optional[object] = None  # the router's: engine/continuation.Continuation
    return_text_in_logprobs: bool = False  # /generate: each logprob entry names its token's text
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs, if asked)
    logprob_start_len: int = -1  # /generate: the prompt's logprobs from this token (-1: none)
    stop_matcher: Optional[object] = field(default=None, compare=False, repr=False)
    """The automaton of ``sampling.stop``, built with a tokenizer (on the worker's tokenizer
    thread, not the engine loop's)."""
    grammar_spec: Optional[object] = None  # engine/grammar.GrammarSpec of response_format (or a forced tool call)
    tools: Optional[object] = None  # chat: engine/grammar.ToolsSpec of tools and tool_choice; None: no tools
    grammar_param: Optional[str] = None
    """The field a refusal of ``grammar_spec`` names; set when ``grammars`` is to compile it, which
    happens after validation, off the tokenize lanes (``server/tokenize_lanes.py``)."""
    grammar: Optional[object] = field(default=None, compare=False, repr=False)
    """``grammar_spec`` compiled for this request (``engine/grammar_compiler.Grammar``)."""

    def generate_request(self, rid: Optional[str] = None) -> GenerateRequest:
        """The engine request; ``rid`` defaults to the client's ``rid``."""
        rid = rid if rid is not None else self.rid
        if rid is None or self.prompt_ids is None:
            raise ValueError("generate_request needs a rid and tokenized prompt (validate with a tokenizer)")
        bootstrap = None
        if self.bootstrap_room is not None and self.bootstrap_host is not None and self.bootstrap_port is not None:
            bootstrap = Bootstrap(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)
        return GenerateRequest(rid=rid, prompt_ids=self.prompt_ids, sampling=self.sampling, bootstrap=bootstrap,
                               cache_salt=self.cache_salt, stop_matcher=self.stop_matcher, grammar=self.grammar,
                               continuation=self.continuation)


def parse_json_body(raw: bytes | str) -> dict:
    """Decode a request body into a JSON object, or raise InvalidRequest saying what is wrong."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"the request body is not valid UTF-8: {e}") from None
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")

    def _no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {_type_name(body)}")
    return body


def check_text(body: Any) -> None:
    """Refuse a lone surrogate (``"\\ud800"``, legal JSON) anywhere in a parsed body, keys
    included: it is no character and cannot be encoded as UTF-8, so it would raise wherever the
    request is hashed (``cache_salt``), tokenized, logged or forwarded. One pass over the body,
    iterative (any depth); a pure-ASCII string is skipped in constant time."""
    todo: list[tuple[Any, str]] = [(body, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                raise InvalidRequest(f"{path or 'the request body'} holds a lone surrogate (\\ud800-\\udfff "
                                     "without its pair): not text", path or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not key.isascii() and not _encodable(key):
                    where = f"`{path}`" if path else "the request body"
                    raise InvalidRequest(f"a field name in {where} holds a lone surrogate: not text", path or None)
                todo.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, list):
            todo.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


REQUEST_ID = "X-Request-Id"  # the header that carries a request id (the router's, on the OpenAI routes)
DEADLINE = "X-Splitserve-Deadline-S"  # the seconds a router gives a leg (docs/router.md, *Deadlines*)
MAX_DEADLINE_S = 1e6


def check_deadline(text: Optional[str]) -> Optional[float]:
    """A deadline header's value: decimal seconds, finite, above 0 and at most ``MAX_DEADLINE_S``,
    in at most 32 characters; None stays None. Anything else is a 400 naming the header."""
    if text is None:
        return None
    try:
        value = float(text) if len(text) <= 32 and all(c in "0123456789.eE+-" for c in text) else math.nan
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_DEADLINE_S:  # NaN fails too
        raise InvalidRequest(f"{DEADLINE} must be a number of seconds above 0 and at most {MAX_DEADLINE_S:g}",
                             DEADLINE)
    return value


def check_request_id(rid: Optional[str], param: str) -> Optional[str]:
    """A request id (the ``rid`` field, or an ``X-Request-Id`` header): 1 to 256 printable
    characters without spaces; None stays None."""
    if rid is not None and (not rid or len(rid) > 256 or not rid.isprintable() or any(c.isspace() for c in rid)):
        raise InvalidRequest(f"{param} must be 1 to 256 printable characters without spaces", param)
    return rid


def validate_request(body: Any, endpoint: str, *, served_model_name: Optional[str] = None, tokenizer=None,
                     max_context: Optional[int] = None, vocab_size: Optional[int] = None,
                     generation_defaults: Optional[Mapping[str, Any]] = None,
                     chars_per_token: Optional[int] = None, grammars=None) -> ValidatedRequest:
    """Check a request body (dict, or raw JSON bytes/str) for ``endpoint`` and return it in the
    engine's terms. With a ``tokenizer`` the prompt is tokenized (chat through the chat template
    with the generation prompt) and checked against ``max_context``; ``vocab_size`` bounds token
    ids. ``chars_per_token`` (:func:`max_chars_per_token` of the tokenizer): a text prompt whose
    length in characters already proves it cannot fit ``max_context`` is refused before it is
    tokenized. ``grammars`` (an ``engine/grammar_compiler.GrammarCompiler``, with a ``tokenizer``):
    prepared to compile ``response_format`` (``grammar_param`` set; the caller compiles it),
    else it is only checked. Raises InvalidRequest (400, or 404 for an unknown model) naming the
    field. The parts run in a fixed order, so a request with several faults names the same one
    on every process."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, not {endpoint!r}")
    if not isinstance(body, dict):
        body = parse_json_body(body)
    check_text(body)
    _check_fields(body, KNOWN[endpoint], "")
    where = _where(body, endpoint)
    model = _model(body, served_model_name)
    echo = endpoint == "completions" and bool(_opt(body, "echo", "", bool))
    start = _opt(body, "logprob_start_len", "", int, minimum=-1) if endpoint == "generate" else None
    start = -1 if start is None or not body.get("return_logprob") else start
    # the prompt alone (max_tokens 0) is what echo and the prompt's logprobs may ask for
    sampling = _sampling(where, endpoint, vocab_size, min_tokens=0 if echo or start >= 0 else 1)
    stream = _opt(body, "stream", "", bool) or False
    include_usage = _include_usage(body, endpoint, stream)
    bootstrap = _bootstrap(body)
    logprobs = _logprobs(body, endpoint)
    return_text_in_logprobs = bool(_opt(body, "return_text_in_logprobs", "", bool))
    grammar_spec, tools = _structured(body, where.fields, endpoint)
    n = _opt(where.fields, "n", where.prefix, int, minimum=1, maximum=MAX_N) or 1
    if n > 1 and sampling["max_tokens"] == 0:
        raise InvalidRequest("n > 1 needs max_tokens of at least 1", where.prefix + "n")
    prompt_text, prompt_ids, messages = _prompt(body, endpoint, tools, tokenizer, vocab_size)
    max_tokens_set = sampling["max_tokens"] is not None
    prompt_ids, sampling["max_tokens"] = _fit_prompt(
        prompt_text, prompt_ids, messages, tools, sampling["max_tokens"], where.prefix + where.max_key,
        _Limits(tokenizer, max_context, chars_per_token))
    if prompt_ids is not None and start >= len(prompt_ids):
        raise InvalidRequest(f"logprob_start_len {start} is not below the prompt's {len(prompt_ids)} tokens",
                             "logprob_start_len")
    return _router_fields(body, vocab_size, ValidatedRequest(
        endpoint=endpoint, model=model, stream=stream, include_usage=include_usage,
        sampling=_sampling_params(sampling, dict(generation_defaults or {}), logprobs=logprobs, n=n,
                                  prompt_logprobs=logprobs if echo or start >= 0 else None),
        prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None, prompt_text=prompt_text,
        messages=messages, max_tokens_set=max_tokens_set, **bootstrap,
        return_text_in_logprobs=return_text_in_logprobs, echo=echo, logprob_start_len=start,
        stop_matcher=stop_matcher(sampling["stop"]) if sampling["stop"] and tokenizer is not None else None,
        grammar_spec=grammar_spec, tools=tools,
        grammar_param=_grammar_param(grammar_spec, endpoint, grammars, tokenizer, vocab_size),
    ))


def _router_fields(body: dict, vocab_size: Optional[int], req: ValidatedRequest) -> ValidatedRequest:
    """``stream_ids`` and ``continuation`` (``engine/continuation.py``), checked against the request."""
    ids = bool(_opt(body, "stream_ids", "", bool))
    cont = parse_continuation(body.get("continuation"), req.endpoint, stream=req.stream, n=req.sampling.n,
                              max_tokens=req.sampling.max_tokens, vocab_size=vocab_size)
    return replace(req, stream_ids=ids, continuation=cont) if ids or cont is not None else req


# -- the parts of validate_request, in the order it runs them ------------------------------------------


@dataclass(frozen=True)
class _Where:
    """Where an endpoint's sampling fields are: the body, or ``/generate``'s ``sampling_params``."""

    fields: dict
    prefix: str  # how an error names one of them: "" or "sampling_params."
    max_key: str  # the field of max_tokens here
    max_stop: int  # how many stop strings it may give


@dataclass(frozen=True)
class _Limits:
    """What the worker knows of its model that bounds a prompt (all None on the router)."""

    tokenizer: Any
    max_context: Optional[int]
    chars_per_token: Optional[int]


def _where(body: dict, endpoint: str) -> _Where:
    if endpoint == "generate":
        sp = body.get("sampling_params")
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise InvalidRequest(f"sampling_params must be an object, not {_type_name(sp)}", "sampling_params")
        _check_fields(sp, KNOWN["sampling_params"], "sampling_params.")
        if sp.get("seed") is not None and sp.get("sampling_seed") is not None:
            raise InvalidRequest("give seed or sampling_seed, not both", "sampling_params.seed")
        return _Where(sp, "sampling_params.", "max_new_tokens", MAX_STOP)
    max_key = "max_tokens"
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None and body["max_tokens"] != body["max_completion_tokens"]:
            raise InvalidRequest("max_tokens and max_completion_tokens differ; give one", "max_tokens")
        max_key = "max_completion_tokens"
    return _Where(body, "", max_key, MAX_OPENAI_STOP)


def _model(body: dict, served_model_name: Optional[str]) -> Optional[str]:
    model = _opt(body, "model", "", str)
    if model is not None and served_model_name is not None and model != served_model_name:
        raise InvalidRequest(f"The model `{model}` does not exist; this server serves `{served_model_name}`",
                             "model", reason=Reason.MODEL_NOT_FOUND)
    return model


def _sampling(where: _Where, endpoint: str, vocab_size: Optional[int], min_tokens: int) -> dict[str, Any]:
    """The sampling fields, checked, by ``SamplingParams``' names; None where absent (the
    defaults are :func:`_sampling_params`')."""
    f, prefix = where.fields, where.prefix
    out: dict[str, Any] = {"max_tokens": _opt(f, where.max_key, prefix, int, minimum=min_tokens)}
    out["temperature"] = _opt(f, "temperature", prefix, float, minimum=0.0)
    out["top_p"] = top_p = _opt(f, "top_p", prefix, float)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"{prefix}top_p must be in (0, 1], got {top_p}", prefix + "top_p")
    top_k = _opt(f, "top_k", prefix, int, minimum=-1)
    out["top_k"] = 0 if top_k == -1 else top_k
    seed_key = "sampling_seed" if f.get("sampling_seed") is not None else "seed"
    out["seed"] = _opt(f, seed_key, prefix, int, minimum=0, maximum=MAX_SEED - 1)
    out["ignore_eos"] = bool(_opt(f, "ignore_eos", prefix, bool))
    out["stop"] = _stop(f.get("stop"), prefix + "stop", where.max_stop)
    out["stop_token_ids"] = tuple(_token_ids(f.get("stop_token_ids"), prefix + "stop_token_ids", vocab_size,
                                             allow_empty=True, max_count=MAX_STOP_TOKEN_IDS) or ())
    out["presence_penalty"] = _opt_range(f, "presence_penalty", prefix, -2.0, 2.0) or 0.0
    out["frequency_penalty"] = _opt_range(f, "frequency_penalty", prefix, -2.0, 2.0) or 0.0
    repetition = _opt_range(f, "repetition_penalty", prefix, 0.0, 2.0, open_below=True) \
        if endpoint == "generate" else None
    out["repetition_penalty"] = repetition if repetition is not None else 1.0
    out["logit_bias"] = _logit_bias(f.get("logit_bias"), vocab_size) if endpoint != "generate" else ()
    return out


def _include_usage(body: dict, endpoint: str, stream: bool) -> bool:
    if body.get("stream_options") is None:
        return False
    if endpoint == "generate":
        raise InvalidRequest("stream_options is not supported by /generate", "stream_options")
    return _stream_options(body["stream_options"], stream)


def _bootstrap(body: dict) -> dict[str, Any]:
    """Who the request is and where its KV comes from: ``rid``, ``bootstrap_host``, ``_port``,
    ``_room`` and ``cache_salt``, by ``ValidatedRequest``'s names (``user`` is read, not kept)."""
    _opt(body, "user", "", str)  # accepted (OpenAI's end-user id), not used
    rid = check_request_id(_opt(body, "rid", "", str), "rid")
    host = _opt(body, "bootstrap_host", "", str)
    if host is not None:  # in the one form the router sends and the allow-lists compare
        try:
            host = check_host(host)
        except ValueError as exc:
            raise InvalidRequest(f"bootstrap_host must be a host name, an IPv4 address or an IPv6 address in "
                                 f"brackets: {exc}", "bootstrap_host") from None
    port = _opt(body, "bootstrap_port", "", int, minimum=1, maximum=65535)
    room = _opt(body, "bootstrap_room", "", int, minimum=0, maximum=MAX_ROOM - 1)
    cache_salt = _opt(body, "cache_salt", "", str) or ""
    if len(cache_salt) > 256:
        raise InvalidRequest("cache_salt must be at most 256 characters", "cache_salt")
    return {"rid": rid, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room,
            "cache_salt": cache_salt}


def _structured(body: dict, fields: dict, endpoint: str) -> tuple[Any, Any]:
    """The grammar the answer must follow (``response_format``, SGLang's ``regex`` or
    ``json_schema``, or a forced tool call) and the chat's tools; None for either when absent."""
    grammar_spec = parse_response_format(body.get("response_format")) if endpoint != "generate" else \
        sglang_spec(fields)
    tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")) \
        if endpoint == "chat" else None
    if tools is not None and tools.grammar is not None:
        if grammar_spec is not None:
            raise InvalidRequest("a forced tool call (tool_choice required or a function) and response_format "
                                 "cannot be given together", "tool_choice")
        grammar_spec = tools.grammar
    return grammar_spec, tools


def _prompt(body: dict, endpoint: str, tools, tokenizer, vocab_size: Optional[int]) \
        -> tuple[Optional[str], Optional[list[int]], Optional[tuple[dict, ...]]]:
    """The prompt as given: its text, its token ids or the chat's messages."""
    if endpoint == "completions":
        return (*_completion_prompt(body.get("prompt", _ABSENT), vocab_size), None)
    if endpoint == "generate":
        return (*_generate_prompt(body, vocab_size), None)
    messages = _messages(body.get("messages", _ABSENT))
    if tools is not None and tools.parses and tokenizer is not None and not renders_tools(tokenizer):
        raise InvalidRequest("this model's chat template does not render tools, so the model would never see "
                             "them; serve it with --chat-template FILE, a template that does", "tools")
    return None, None, messages


def _fit_prompt(text: Optional[str], ids: Optional[list[int]], messages: Optional[tuple[dict, ...]], tools,
                max_tokens: Optional[int], param: str, limits: _Limits) -> tuple[Optional[list[int]], int]:
    """The prompt's token ids (tokenized here when a tokenizer is given) and ``max_tokens`` as
    the context leaves it (absent: :data:`DEFAULT_MAX_TOKENS`, lowered to fit); ``param`` names
    the max-tokens field in errors."""
    explicit = max_tokens is not None
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    tokenizer, max_context, chars_per_token = limits.tokenizer, limits.max_context, limits.chars_per_token
    if tokenizer is not None and ids is None:
        if chars_per_token and max_context is not None:
            chars = len(text) if messages is None else len(_render(tokenizer, messages, tools))
            _fit_context(-(-chars // chars_per_token), max_tokens, explicit, max_context, param,
                         bound=f"{chars} characters, and no token of this model stands for more than {chars_per_token}")
        ids = _tokenize(tokenizer, text, messages, tools)
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenization", "messages" if messages else "prompt")
    if ids is not None and max_context is not None:
        max_tokens = _fit_context(len(ids), max_tokens, explicit, max_context, param)
    return ids, max_tokens


def _sampling_params(values: dict[str, Any], defaults: dict, **rest: Any) -> SamplingParams:
    """``SamplingParams`` of :func:`_sampling`'s values, the model's generation defaults (else
    the API's) where the client gave none, and ``rest``."""
    return SamplingParams(**{
        **values, **rest,
        "temperature": _pick(values["temperature"], defaults.get("temperature"), 1.0),
        "top_p": _pick(values["top_p"], defaults.get("top_p"), 1.0),
        "top_k": int(_pick(values["top_k"], defaults.get("top_k"), 0)),
    })


def _grammar_param(spec, endpoint: str, grammars, tokenizer, vocab_size: Optional[int]) -> Optional[str]:
    """The field a refusal of ``spec`` names, when ``grammars`` is to compile it (with a
    tokenizer: its view of the tokenizer is built here, once per worker, in this thread)."""
    if spec is None or grammars is None or tokenizer is None:
        return None
    grammars.prepare(tokenizer, vocab_size or len(tokenizer))
    if spec.kind == "lark":
        return "tool_choice"
    return "response_format" if endpoint != "generate" else f"sampling_params.{spec.kind}"


# -- pieces ----------------------------------------------------------------------------------------


def _logprobs(body: dict, endpoint: str) -> Optional[int]:
    """How many alternatives per token the request wants logprobs for; None: no logprobs."""
    if endpoint == "completions":
        return _opt(body, "logprobs", "", int, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if endpoint == "chat":
        on, top_key = _opt(body, "logprobs", "", bool), "top_logprobs"
    else:
        on, top_key = _opt(body, "return_logprob", "", bool), "top_logprobs_num"
    k = _opt(body, top_key, "", int, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if k and not on:
        flag = "logprobs" if endpoint == "chat" else "return_logprob"
        raise InvalidRequest(f"{top_key} needs {flag}: true", top_key)
    return (k or 0) if on else None


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def _check_fields(obj: dict, known: set, prefix: str) -> None:
    for key, value in obj.items():
        name = prefix + str(key)
        if key not in known:
            raise InvalidRequest(f"unrecognized request field `{name}`", name)
        if key in NOOP and value is not None and not _is_noop(value, NOOP[key]):
            raise InvalidRequest(f"`{name}` is not supported by this server (got {json.dumps(value)})", name)


def _is_noop(value: Any, noop: Any) -> bool:
    if noop is ABSENT:
        return False
    if noop is ANY_BOOL:
        return isinstance(value, bool)
    if isinstance(noop, bool) or isinstance(value, bool):
        return type(value) is type(noop) and value == noop
    return value == noop


def _pick(value, default, fallback):
    if value is not None:
        return value
    return default if default is not None else fallback


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def _opt(obj: dict, key: str, prefix: str, kind: type, minimum=None, maximum=None) -> Any:
    """``obj[key]`` checked as ``kind`` (int, float: any finite number, returned as a float; bool;
    str) and within ``minimum``/``maximum``, or None when absent or null. A bool is no number."""
    v = obj.get(key)
    if v is None:
        return None
    name = prefix + key
    accepted = (int, float) if kind is float else kind
    if (isinstance(v, bool) and kind is not bool) or not isinstance(v, accepted):
        raise InvalidRequest(f"{name} must be {_KIND_NAMES[kind]}, not {_type_name(v)}", name)
    if kind is float and not math.isfinite(v):
        raise InvalidRequest(f"{name} must be a finite number", name)
    if minimum is not None and v < minimum:
        raise InvalidRequest(f"{name} must be at least {minimum}, got {v}", name)
    if maximum is not None and v > maximum:
        raise InvalidRequest(f"{name} must be at most {maximum}, got {v}", name)
    return float(v) if kind is float else v


# server/tokenization.py reads its fields with these two
_opt_bool = functools.partial(_opt, kind=bool)
_opt_str = functools.partial(_opt, kind=str)


def _opt_range(obj: dict, key: str, prefix: str, low: float, high: float, open_below: bool = False) -> Optional[float]:
    """A number in [low, high] (``(low, high]`` with ``open_below``), or None when absent."""
    v = _opt(obj, key, prefix, float)
    if v is not None and not ((low < v if open_below else low <= v) and v <= high):
        bounds = f"({low:g}, {high:g}]" if open_below else f"[{low:g}, {high:g}]"
        raise InvalidRequest(f"{prefix}{key} must be in {bounds}, got {v:g}", prefix + key)
    return v


def _logit_bias(v: Any, vocab_size: Optional[int]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object of token id (a string of digits) to a number in
    [-100, 100], at most :data:`MAX_LOGIT_BIAS` of them; as sorted (token, bias) pairs."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidRequest(f"logit_bias must be an object of token id to bias, not {_type_name(v)}", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(v)}", "logit_bias")
    out = {}
    for key, bias in v.items():
        name = f"logit_bias.{key}"
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise InvalidRequest(f"logit_bias keys must be token ids (strings of digits), got {json.dumps(str(key)[:24])}",
                                 "logit_bias")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise InvalidRequest(f"logit_bias names token {token}, not a token id in [0, {vocab_size})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise InvalidRequest(f"{name} must be a finite number, not {_type_name(bias)}", "logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise InvalidRequest(f"{name} must be in [-100, 100], got {bias:g}", "logit_bias")
        out[token] = float(bias)  # "07" and "7" name one token: the last one holds
    return tuple(sorted((t, b) for t, b in out.items() if b))


def _stop(v: Any, name: str, max_count: int) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest(f"{name} must be a string or a list of strings", name)
    if len(stops) > max_count:
        raise InvalidRequest(f"{name} takes at most {max_count} strings, got {len(stops)}", name)
    if any(s == "" for s in stops):
        raise InvalidRequest(f"{name} strings must not be empty", name)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        longest = max(len(s) for s in stops)
        raise InvalidRequest(f"{name} strings take at most {MAX_STOP_CHARS} characters, got {longest}", name)
    return tuple(dict.fromkeys(stops))


def _token_ids(v: Any, name: str, vocab_size: Optional[int], allow_empty: bool = False,
               max_count: Optional[int] = None) -> Optional[list[int]]:
    if v is None:
        return None
    if not isinstance(v, list):
        raise InvalidRequest(f"{name} must be a list of token ids, not {_type_name(v)}", name)
    if not v and not allow_empty:
        raise InvalidRequest(f"{name} is empty", name)
    if max_count is not None and len(v) > max_count:
        raise InvalidRequest(f"{name} takes at most {max_count} token ids, got {len(v)}", name)
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequest(f"{name}[{i}] must be an integer token id, not {_type_name(t)}", name)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f" in [0, {vocab_size})" if vocab_size is not None else " >= 0"
            raise InvalidRequest(f"{name}[{i}] = {t} is not a token id{bound}", name)
    return list(v)


def _stream_options(v: Any, stream: bool) -> bool:
    if not isinstance(v, dict):
        raise InvalidRequest(f"stream_options must be an object, not {_type_name(v)}", "stream_options")
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    for key in v:
        if key != "include_usage":
            raise InvalidRequest(f"unrecognized request field `stream_options.{key}`", f"stream_options.{key}")
    return bool(_opt(v, "include_usage", "stream_options.", bool))


def _completion_prompt(v: Any, vocab_size: Optional[int]) -> tuple[Optional[str], Optional[list[int]]]:
    if v is _ABSENT or v is None:
        raise InvalidRequest("prompt is required", "prompt")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise InvalidRequest("prompt is empty", "prompt")
        return v, None
    if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
        raise InvalidRequest(f"batched prompts are not supported: send one prompt per request, got {len(v)}",
                             "prompt")
    if isinstance(v, list):
        return None, _token_ids(v, "prompt", vocab_size)
    raise InvalidRequest(f"prompt must be a string or a list of token ids, not {_type_name(v)}", "prompt")


def _generate_prompt(body: dict, vocab_size: Optional[int]) -> tuple[Optional[str], Optional[list[int]]]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequest("give exactly one of text and input_ids", "text")
    if text is not None:
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, not {_type_name(text)} (batches are not supported)",
                                 "text")
        if not text:
            raise InvalidRequest("text is empty", "text")
        return text, None
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise InvalidRequest("input_ids must be one list of token ids (batches are not supported)", "input_ids")
    return None, _token_ids(ids, "input_ids", vocab_size)


def _messages(v: Any) -> tuple[dict, ...]:
    if v is _ABSENT or v is None:
        raise InvalidRequest("messages is required", "messages")
    if not isinstance(v, list):
        raise InvalidRequest(f"messages must be a list, not {_type_name(v)}", "messages")
    if not v:
        raise InvalidRequest("messages is empty", "messages")
    out = []
    for i, m in enumerate(v):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{name} must be an object, not {_type_name(m)}", name)
        role = m.get("role")
        allowed = ("role", "content", "name") + {"assistant": ("tool_calls", "refusal"),
                                                 "tool": ("tool_call_id",)}.get(role, ())
        for key in m:
            if key not in allowed:
                raise InvalidRequest(f"`{name}.{key}` is not supported by this server", f"{name}.{key}")
        if role not in CHAT_ROLES:
            if isinstance(role, str) and role == "function":
                raise InvalidRequest(f"{name}.role `function` is not supported (use tools and the tool role)",
                                     f"{name}.role")
            raise InvalidRequest(f"{name}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}",
                                 f"{name}.role")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise InvalidRequest(f"{name}.name must be a string", f"{name}.name")
        msg = {"role": CHAT_ROLES[role]}
        calls = m.get("tool_calls")
        if role == "assistant" and calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"{name}.tool_calls")
            msg["content"] = _content(m["content"], f"{name}.content") if m.get("content") is not None else ""
        else:
            msg["content"] = _content(m.get("content"), f"{name}.content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not 0 < len(m["tool_call_id"]) <= 256:
                raise InvalidRequest(f"{name}.tool_call_id must be a string of 1 to 256 characters",
                                     f"{name}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None and role == "tool":
            msg["name"] = m["name"]
        out.append(msg)
    return tuple(out)


def _tool_calls(v: Any, name: str) -> list[dict]:
    """An assistant message's ``tool_calls``, for the chat template: ``arguments`` (a JSON string
    in OpenAI's API) parsed into an object, as templates write it with ``tojson`` (vLLM does so too)."""
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise InvalidRequest(f"{name} must be an array of at most {MAX_TOOLS} calls", name)
    out = []
    for j, call in enumerate(v):
        p = f"{name}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str) \
                or set(call) - {"id", "type", "function"} or set(fn) - {"name", "arguments"}:
            raise InvalidRequest(f"{p} must be {{\"id\", \"type\": \"function\", \"function\": "
                                 "{\"name\", \"arguments\": a JSON string}}", p)
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise InvalidRequest(f"{p}.id must be a string", f"{p}.id")
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError:
            raise InvalidRequest(f"{p}.function.arguments is not JSON", f"{p}.function.arguments") from None
        out.append({"id": call.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _content(v: Any, name: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise InvalidRequest(f"{name}[{j}]: only text parts are supported, got {json.dumps(kind)}", name)
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(f"{name} must be a string or a list of text parts, not {_type_name(v)}", name)


def _template_tools(tools) -> dict:
    """The chat template's ``tools`` argument (none for ``tool_choice`` none: vLLM's
    ``--exclude-tools-when-tool-choice-none``, here always; OpenAI's model then calls no tool)."""
    return {"tools": [dict(t) for t in tools.tools]} if tools is not None and tools.parses else {}


_PROBE_TOOL = {"type": "function", "function": {"name": "splitserve_probe_function", "parameters": {}}}


def renders_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template writes the tools it is given into the prompt: a probe
    function's name appears when rendered with it (cached per template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return False
    hit = _RENDERS_TOOLS.get(template)
    if hit is None:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL],
                                                 add_generation_prompt=True, tokenize=False)
            hit = "splitserve_probe_function" in text
        except Exception:
            hit = False
        if len(_RENDERS_TOOLS) > 16:
            _RENDERS_TOOLS.clear()
        _RENDERS_TOOLS[template] = hit
    return hit


_RENDERS_TOOLS: dict[str, bool] = {}


def _tokenize(tokenizer, text: Optional[str], messages: Optional[tuple[dict, ...]], tools=None) -> list[int]:
    if messages is None:
        return list(tokenizer.encode(text))
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **_template_tools(tools))
    except Exception as e:  # jinja TemplateError raised by the template itself ("roles must alternate")
        raise InvalidRequest(f"the chat template refused these messages: {e}", "messages") from None
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _render(tokenizer, messages: tuple[dict, ...], tools=None) -> str:
    """The text the chat template makes of ``messages`` (what ``_tokenize`` then tokenizes)."""
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                             **_template_tools(tools))
    except Exception as e:
        raise InvalidRequest(f"the chat template refused these messages: {e}", "messages") from None


def _fit_context(n_prompt: int, max_tokens: int, explicit: bool, max_context: int, param: str,
                 bound: Optional[str] = None) -> int:
    """``max_tokens`` as the context leaves it, or InvalidRequest. ``bound``: ``n_prompt`` is a
    lower bound on the prompt's tokens, for the reason it says."""
    if n_prompt + max_tokens <= max_context:
        return max_tokens
    has = f"has {n_prompt} tokens" if bound is None else f"has at least {n_prompt} tokens ({bound})"
    if explicit:
        raise InvalidRequest(f"prompt {has} and {param} is {max_tokens}, but the model's "
                             f"context is {max_context}", param)
    if n_prompt >= max_context:
        raise InvalidRequest(f"prompt {has}, but the model's context is {max_context} "
                             f"(at least one token must be left to generate)", "prompt")
    return max_context - n_prompt


# -- how many characters one token can stand for -----------------------------------------------------

_KEEPS = {"Prepend", "NFD", "NFKD", "Lowercase"}  # normalizers that never shorten a text
_COMPOSES = {"NFC", "NFKC"}  # may fold up to MAX_COMPOSED characters into one
MAX_COMPOSED = 4
"""The most characters Unicode composes into one (the longest canonical decomposition, e.g.
U+1F82 GREEK SMALL LETTER ALPHA WITH PSILI AND VARIA AND YPOGEGRAMMENI)."""
_SPLITS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}  # keep every character


def max_chars_per_token(tokenizer) -> Optional[int]:
    """At most how many characters of a prompt one token of ``tokenizer`` stands for, or None when
    no such bound is known (then a prompt is tokenized before its length is checked).

    Why it holds, for a Hugging Face fast tokenizer. It normalizes the text, splits it
    (pre-tokenizer) and cuts each piece into tokens of its vocabulary, whose strings, joined, are
    the pieces again. So one token stands for at most as many characters of the normalized text as
    its string is long: with ``ByteLevel`` each character of a token's string is one byte, and a
    character is at least one byte; with ``Metaspace`` each is one character (``▁`` a space); a
    byte-fallback token (``<0xE3>``) stands for less than one; and an added token found in the text
    as is (``<|im_start|>``) for its content. Normalizing can shorten a text only by composing
    characters (NFC, NFKC), at most :data:`MAX_COMPOSED` into one. So a text of ``C`` characters
    has at least ``C / (L * S)`` tokens, where ``L`` is the longest token string (vocabulary and
    added tokens) and ``S`` is 4 with a composing normalizer, else 1; a chat template only adds
    text (the bound is taken on what it renders). A step that may drop characters (a normalizer
    that strips or replaces, a pre-tokenizer that removes whitespace), a fused unknown token
    (WordPiece's ``[UNK]`` for a whole word) or a tokenizer of another kind: no bound (None).
    Measured: 43 for the tiny model, 81 for SmolLM2 (its longest token is a newline and 80
    spaces); the byte tokenizer of the tests: 4 (``</s>``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:
        return None
    model = spec.get("model") or {}
    fold = _normalizer_fold(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if fold is None or not _keeps_characters(pre):
        return None
    byte_level = "ByteLevel" in json.dumps(pre)
    if model.get("type") == "BPE":
        if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback") \
                and not byte_level:
            return None  # a run of unknown characters may become one token
    elif model.get("type") != "Unigram" or not model.get("byte_fallback"):
        return None
    vocab = model.get("vocab")
    strings = vocab.keys() if isinstance(vocab, dict) else [piece[0] for piece in vocab or ()]
    longest = max([len(s) for s in strings] + [len(a.get("content", "")) for a in spec.get("added_tokens") or ()],
                  default=0)
    return longest * fold if longest > 0 else None


def _normalizer_fold(n: Optional[dict]) -> Optional[int]:
    """How many characters the normalizer may fold into one (1: it never shortens); None: unknown."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind == "Sequence":
        folds = [_normalizer_fold(x) for x in n.get("normalizers") or ()]
        return None if None in folds else max(folds, default=1)  # composing twice composes no further
    if kind in _KEEPS:
        return 1
    if kind in _COMPOSES:
        return MAX_COMPOSED
    if kind == "Replace":
        pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
        if isinstance(pattern, str) and isinstance(content, str) and len(content) >= len(pattern) > 0:
            return 1
    return None


def _keeps_characters(p: Optional[dict]) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(x) for x in p.get("pretokenizers") or ())
    return kind in _SPLITS and p.get("behavior") != "Removed"
