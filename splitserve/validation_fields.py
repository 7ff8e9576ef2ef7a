"""The request fields each endpoint takes, as one table: name, where it may be given, its rule and
where its value goes. The known-field sets and the no-op values that ``validation/`` and
``server/tokenization.py`` check against are derived from it, and ``docs/requests.md``'s table
(of the generation fields) is checked against it (``tests/test_validation.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GENERATION_PLACES = ("completions", "chat", "generate", "sampling_params")
"""Where a generation field is given: the body of ``/v1/completions``, of
``/v1/chat/completions``, of ``/generate``, or ``/generate``'s ``sampling_params`` object."""
PLACES = GENERATION_PLACES + ("tokenize", "detokenize")
"""And the bodies of a worker's ``/tokenize`` and ``/detokenize`` (``server/tokenization.py``)."""

ABSENT = object()  # a no-op field whose only accepted value is absence (or null)
ANY_BOOL = object()  # a switch with no effect on the tokens (logging, reasoning display): any boolean
USED = object()  # a field this server implements

OPENAI = ("completions", "chat")
ALL = ("completions", "chat", "generate")
SAMPLED = ("completions", "chat", "sampling_params")  # sampling fields: top level, or in sampling_params


@dataclass(frozen=True)
class Field:
    """One request field: ``places`` from :data:`PLACES`; ``rule``, what a valid value is;
    ``goes``, the ``ValidatedRequest``/``SamplingParams`` attributes its value sets (none: read
    and not used, or not implemented); ``noop``, for a field of the OpenAI or SGLang API this
    server does not implement, the one value that means "not used" (others are refused)."""

    name: str
    places: tuple[str, ...]
    rule: str = ""
    goes: tuple[str, ...] = ()
    noop: Any = USED


def _noop(name: str, places: tuple[str, ...], value: Any) -> Field:
    return Field(name, places, noop=value)


FIELDS: tuple[Field, ...] = (
    # -- what is asked, and how the answer comes
    Field("model", ALL + ("tokenize", "detokenize"), "the served model's name (another is a 404); absent: the served one", ("ValidatedRequest.model",)),
    Field("stream", ALL, "boolean", ("ValidatedRequest.stream",)),
    Field("stream_options", OPENAI, "`{\"include_usage\": boolean}`, only with `stream: true`",
          ("ValidatedRequest.include_usage",)),
    Field("user", OPENAI, "string; accepted and not used"),
    Field("rid", ALL, "the request id: 1 to 256 printable characters without spaces", ("ValidatedRequest.rid",)),
    # -- the prompt
    Field("prompt", ("completions", "tokenize"), "a non-empty string or list of token ids (a batch of one is taken)",
          ("ValidatedRequest.prompt_text", "ValidatedRequest.prompt_ids")),
    Field("messages", ("chat", "tokenize"), "a non-empty list of `{role, content}` (roles system, developer, user, "
          "assistant with `tool_calls`, tool with `tool_call_id`); content a string or text parts",
          ("ValidatedRequest.messages", "ValidatedRequest.prompt_ids")),
    Field("text", ("generate",), "a non-empty string; exactly one of `text` and `input_ids`",
          ("ValidatedRequest.prompt_text", "ValidatedRequest.prompt_ids")),
    Field("input_ids", ("generate",), "one non-empty list of token ids", ("ValidatedRequest.prompt_ids",)),
    Field("sampling_params", ("generate",), "an object of the fields marked `sampling_params`"),
    Field("echo", ("completions",), "boolean: the answer starts with the prompt (with `logprobs`, its logprobs too)",
          ("ValidatedRequest.echo", "SamplingParams.prompt_logprobs")),
    # -- sampling
    Field("max_tokens", OPENAI, "integer >= 1 (0 with `echo`); absent: 256, lowered to what the context leaves",
          ("SamplingParams.max_tokens", "ValidatedRequest.max_tokens_set")),
    Field("max_completion_tokens", ("chat",), "as `max_tokens`; both given, they must be equal",
          ("SamplingParams.max_tokens", "ValidatedRequest.max_tokens_set")),
    Field("max_new_tokens", ("sampling_params",), "as `max_tokens` (0 with `logprob_start_len` >= 0)",
          ("SamplingParams.max_tokens", "ValidatedRequest.max_tokens_set")),
    Field("temperature", SAMPLED, "number >= 0 (0 is greedy); absent: the model's generation_config, else 1",
          ("SamplingParams.temperature",)),
    Field("top_p", SAMPLED, "number in (0, 1]", ("SamplingParams.top_p",)),
    Field("top_k", SAMPLED, "integer >= -1; 0 and -1 mean no limit", ("SamplingParams.top_k",)),
    Field("seed", SAMPLED, "integer in [0, 2**63)", ("SamplingParams.seed",)),
    Field("sampling_seed", ("sampling_params",), "as `seed`; not both", ("SamplingParams.seed",)),
    Field("stop", SAMPLED, "a string or a list of strings: at most 4 (16 on `/generate`), none empty, each at "
          "most 256 characters", ("SamplingParams.stop", "ValidatedRequest.stop_matcher")),
    Field("stop_token_ids", SAMPLED, "a list of at most 64 token ids", ("SamplingParams.stop_token_ids",)),
    Field("ignore_eos", SAMPLED, "boolean", ("SamplingParams.ignore_eos",)),
    Field("n", SAMPLED, "integer in [1, 16]: choices, each a sequence of its own; above 1 needs `max_tokens` >= 1",
          ("SamplingParams.n",)),
    Field("presence_penalty", SAMPLED, "number in [-2, 2]", ("SamplingParams.presence_penalty",)),
    Field("frequency_penalty", SAMPLED, "number in [-2, 2]", ("SamplingParams.frequency_penalty",)),
    Field("repetition_penalty", ("sampling_params",), "number in (0, 2]; 1 is none",
          ("SamplingParams.repetition_penalty",)),
    Field("logit_bias", OPENAI, "an object of token id (a string of digits, in the vocabulary) to a number in "
          "[-100, 100], at most 300 tokens", ("SamplingParams.logit_bias",)),
    # -- logprobs
    Field("logprobs", OPENAI, "completions: integer in [0, 20], the alternatives per token; chat: boolean",
          ("SamplingParams.logprobs",)),
    Field("top_logprobs", ("chat",), "integer in [0, 20], only with `logprobs: true`", ("SamplingParams.logprobs",)),
    Field("return_logprob", ("generate",), "boolean", ("SamplingParams.logprobs",)),
    Field("top_logprobs_num", ("generate",), "integer in [0, 20], only with `return_logprob: true`",
          ("SamplingParams.logprobs",)),
    Field("logprob_start_len", ("generate",), "integer >= -1: with `return_logprob`, the prompt's logprobs from "
          "this token (below the prompt's length; -1: none)",
          ("ValidatedRequest.logprob_start_len", "SamplingParams.prompt_logprobs")),
    Field("return_text_in_logprobs", ("generate",), "boolean: each logprob entry names its token's text",
          ("ValidatedRequest.return_text_in_logprobs",)),
    # -- structured output and tools
    Field("response_format", OPENAI, "`text`, `json_object` or `json_schema` (`docs/structured_outputs.md`)",
          ("ValidatedRequest.grammar_spec",)),
    Field("regex", ("sampling_params",), "a regular expression the answer matches", ("ValidatedRequest.grammar_spec",)),
    Field("json_schema", ("sampling_params",), "a JSON schema, as a string", ("ValidatedRequest.grammar_spec",)),
    Field("tools", ("chat", "tokenize"), "at most 128 functions (`docs/tools.md`)", ("ValidatedRequest.tools",)),
    Field("tool_choice", ("chat",), "`none`, `auto`, `required` or a named function; a forced call not with "
          "`response_format`", ("ValidatedRequest.tools", "ValidatedRequest.grammar_spec")),
    Field("parallel_tool_calls", ("chat",), "boolean", ("ValidatedRequest.tools",)),
    # -- prefill/decode and the prefix cache
    Field("bootstrap_host", ALL, "a host name, an IPv4 address or an IPv6 address in brackets",
          ("ValidatedRequest.bootstrap_host",)),
    Field("bootstrap_port", ALL, "integer in [1, 65535]", ("ValidatedRequest.bootstrap_port",)),
    Field("bootstrap_room", ALL, "integer in [0, 2**63)", ("ValidatedRequest.bootstrap_room",)),
    Field("stream_ids", ALL, "boolean; the router's (worker key): each streamed event's token ids in an "
          "`: ids` comment line", ("ValidatedRequest.stream_ids",)),
    Field("continuation", ALL, "the router's (worker key): `{id, created, choices: [{index, ids}], "
          "finished_tokens}` of a lost stream, with `stream: true` (`docs/lifecycle.md`)",
          ("ValidatedRequest.continuation",)),
    Field("cache_salt", ALL, "string of at most 256 characters: prefix-cache pages are shared only within a salt",
          ("ValidatedRequest.cache_salt",)),
    # -- /tokenize and /detokenize only (not in docs/requests.md's table: server/tokenization.py)
    Field("add_special_tokens", ("tokenize",), "boolean; absent: true for a prompt, false for messages"),
    Field("add_generation_prompt", ("tokenize",), "boolean, messages only; absent: true"),
    Field("return_token_strs", ("tokenize",), "boolean: the answer names each token's string"),
    Field("tokens", ("detokenize",), "a list of token ids of the vocabulary, at most the context's number"),
    # -- not implemented: accepted only at the value that means "not used"
    _noop("best_of", ("completions",), 1),
    _noop("suffix", ("completions",), ""),
    _noop("functions", ("chat",), []),
    _noop("function_call", ("chat",), "none"),
    _noop("store", ("chat",), False),
    _noop("metadata", ("chat",), ABSENT),
    _noop("modalities", ("chat",), ["text"]),
    _noop("audio", ("chat",), ABSENT),
    _noop("prediction", ("chat",), ABSENT),
    _noop("reasoning_effort", ("chat",), ABSENT),
    _noop("service_tier", ("chat",), ABSENT),
    _noop("web_search_options", ("chat",), ABSENT),
    _noop("verbosity", ("chat",), ABSENT),
    # fields SGLang's gateway adds to every request it forwards, at their defaults
    _noop("no_stop_trim", SAMPLED, False),
    _noop("skip_special_tokens", SAMPLED, True),
    _noop("return_hidden_states", ALL, False),
    _noop("continue_final_message", ("chat",), False),
    _noop("separate_reasoning", ("chat",), ANY_BOOL),
    _noop("stream_reasoning", ("chat",), ANY_BOOL),
    _noop("background", ("generate",), False),
    _noop("return_bytes", ("generate",), False),
    _noop("return_entropy", ("generate",), False),
    _noop("log_metrics", ("generate",), ANY_BOOL),
    _noop("no_logs", ("generate",), ANY_BOOL),
    # SGLang's /generate fields and sampling_params
    _noop("image_data", ("generate",), ABSENT),
    _noop("lora_path", ("generate",), ABSENT),
    _noop("min_p", ("sampling_params",), 0),
    _noop("min_new_tokens", ("sampling_params",), 0),
    _noop("spaces_between_special_tokens", ("sampling_params",), True),
    _noop("ebnf", ("sampling_params",), ABSENT),
)

KNOWN: dict[str, frozenset[str]] = {place: frozenset(f.name for f in FIELDS if place in f.places) for place in PLACES}
"""The fields each place takes; any other is refused with its name."""

NOOP: dict[str, Any] = {f.name: f.noop for f in FIELDS if f.noop is not USED}
"""The fields not implemented, each with the value that means "not used"."""
