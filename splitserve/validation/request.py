"""The request a worker or router has validated (:class:`ValidatedRequest`), what the process
knows that bounds it (:class:`RequestContext`), and :func:`validate_request`, which runs the
parts in a fixed order so a request with several faults names the same one on every process."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from splitserve.engine.detokenizer import stop_matcher
from splitserve.engine.io import Bootstrap, GenerateRequest, InvalidRequest, SamplingParams
import splitserve.validation.sampling as _sampling
from splitserve.validation.body import check_fields, check_model, check_text, parse_json_body
from splitserve.validation.bootstrap import bootstrap, router_fields
from splitserve.validation.prompt import fit_prompt, prompt
from splitserve.validation.structured import grammar_param, structured
from splitserve.validation.values import opt
from splitserve.validation_fields import KNOWN

ENDPOINTS = ("completions", "chat", "generate")


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


@dataclass(frozen=True)
class RequestContext:
    """What the process knows that a request is checked against; all None on the router, which
    checks types, ranges and fields only. With a ``tokenizer`` the prompt is tokenized (chat
    through the chat template with the generation prompt) and checked against ``max_context``;
    ``vocab_size`` bounds token ids. ``chars_per_token`` (``max_chars_per_token`` of the
    tokenizer): a text prompt whose length in characters already proves it cannot fit
    ``max_context`` is refused before it is tokenized. ``grammars`` (an
    ``engine/grammar_compiler.GrammarCompiler``, with a ``tokenizer``): prepared to compile
    ``response_format`` (``grammar_param`` set; the caller compiles it), else it is only checked."""

    served_model_name: Optional[str] = None  # another ``model`` is a 404
    tokenizer: Any = None
    max_context: Optional[int] = None
    vocab_size: Optional[int] = None
    generation_defaults: Optional[Mapping[str, Any]] = None  # the model's, where the client gave none
    chars_per_token: Optional[int] = None
    grammars: Any = None


ROUTER = RequestContext()


def validate_request(body: Any, endpoint: str, context: RequestContext = ROUTER) -> ValidatedRequest:
    """Check a request body (dict, or raw JSON bytes/str) for ``endpoint`` against ``context``
    and return it in the engine's terms. Raises InvalidRequest (400, or 404 for an unknown model)
    naming the field."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, not {endpoint!r}")
    if not isinstance(body, dict):
        body = parse_json_body(body)
    check_text(body)
    check_fields(body, KNOWN[endpoint], "")
    where = _sampling.where(body, endpoint)
    model = check_model(body, context.served_model_name)
    echo = endpoint == "completions" and bool(opt(body, "echo", "", bool))
    start = opt(body, "logprob_start_len", "", int, minimum=-1) if endpoint == "generate" else None
    start = -1 if start is None or not body.get("return_logprob") else start
    vocab_size, tokenizer = context.vocab_size, context.tokenizer
    # the prompt alone (max_tokens 0) is what echo and the prompt's logprobs may ask for
    sampling = _sampling.sampling(where, endpoint, vocab_size, min_tokens=0 if echo or start >= 0 else 1)
    stream = opt(body, "stream", "", bool) or False
    include_usage = _sampling.include_usage(body, endpoint, stream)
    who = bootstrap(body)
    logprobs = _sampling.logprobs(body, endpoint)
    return_text_in_logprobs = bool(opt(body, "return_text_in_logprobs", "", bool))
    grammar_spec, tools = structured(body, where.fields, endpoint)
    n = opt(where.fields, "n", where.prefix, int, minimum=1, maximum=_sampling.MAX_N) or 1
    if n > 1 and sampling["max_tokens"] == 0:
        raise InvalidRequest("n > 1 needs max_tokens of at least 1", where.prefix + "n")
    prompt_text, prompt_ids, messages = prompt(body, endpoint, tools, tokenizer, vocab_size)
    max_tokens_set = sampling["max_tokens"] is not None
    prompt_ids, sampling["max_tokens"] = fit_prompt(
        prompt_text, prompt_ids, messages, tools, sampling["max_tokens"], where.prefix + where.max_key, context)
    if prompt_ids is not None and start >= len(prompt_ids):
        raise InvalidRequest(f"logprob_start_len {start} is not below the prompt's {len(prompt_ids)} tokens",
                             "logprob_start_len")
    req = ValidatedRequest(
        endpoint=endpoint, model=model, stream=stream, include_usage=include_usage,
        sampling=_sampling.sampling_params(sampling, dict(context.generation_defaults or {}), logprobs=logprobs,
                                           n=n, prompt_logprobs=logprobs if echo or start >= 0 else None),
        prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None, prompt_text=prompt_text,
        messages=messages, max_tokens_set=max_tokens_set, **who,
        return_text_in_logprobs=return_text_in_logprobs, echo=echo, logprob_start_len=start,
        stop_matcher=stop_matcher(sampling["stop"]) if sampling["stop"] and tokenizer is not None else None,
        grammar_spec=grammar_spec, tools=tools,
        grammar_param=grammar_param(grammar_spec, endpoint, context.grammars, tokenizer, vocab_size),
    )
    extra = router_fields(body, vocab_size, endpoint, stream=req.stream, n=req.sampling.n,
                          max_tokens=req.sampling.max_tokens)
    return replace(req, **extra) if extra["stream_ids"] or extra["continuation"] is not None else req
