"""The sampling fields of a request: where they are (the body, or ``/generate``'s
``sampling_params``), each checked, the logprobs asked for, and the ``SamplingParams`` they make."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

from splitserve.engine.io import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, InvalidRequest, SamplingParams
from splitserve.validation.body import check_fields
from splitserve.validation.values import opt, opt_range, token_ids, type_name
from splitserve.validation_fields import KNOWN

# Caps on one request's stop conditions, on every route (docs/security.md, "One request's input"):
# with them, matching stop strings costs a bounded amount per generated token and holds a bounded
# automaton (engine/detokenizer.py), whatever a client sends.
MAX_OPENAI_STOP = 4  # stop strings on /v1/completions and /v1/chat/completions (the OpenAI API's own cap)
MAX_STOP = 16  # stop strings on /generate
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids, every route
MAX_N = 16  # choices of one request (n): each is a sequence of its own
MAX_SEED = 2**63


@dataclass(frozen=True)
class Where:
    """Where an endpoint's sampling fields are: the body, or ``/generate``'s ``sampling_params``."""

    fields: dict
    prefix: str  # how an error names one of them: "" or "sampling_params."
    max_key: str  # the field of max_tokens here
    max_stop: int  # how many stop strings it may give


def where(body: dict, endpoint: str) -> Where:
    if endpoint == "generate":
        sp = body.get("sampling_params")
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise InvalidRequest(f"sampling_params must be an object, not {type_name(sp)}", "sampling_params")
        check_fields(sp, KNOWN["sampling_params"], "sampling_params.")
        if sp.get("seed") is not None and sp.get("sampling_seed") is not None:
            raise InvalidRequest("give seed or sampling_seed, not both", "sampling_params.seed")
        return Where(sp, "sampling_params.", "max_new_tokens", MAX_STOP)
    max_key = "max_tokens"
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None and body["max_tokens"] != body["max_completion_tokens"]:
            raise InvalidRequest("max_tokens and max_completion_tokens differ; give one", "max_tokens")
        max_key = "max_completion_tokens"
    return Where(body, "", max_key, MAX_OPENAI_STOP)


def sampling(at: Where, endpoint: str, vocab_size: Optional[int], min_tokens: int) -> dict[str, Any]:
    """The sampling fields, checked, by ``SamplingParams``' names; None where absent (the
    defaults are :func:`sampling_params`')."""
    f, prefix = at.fields, at.prefix
    out: dict[str, Any] = {"max_tokens": opt(f, at.max_key, prefix, int, minimum=min_tokens)}
    out["temperature"] = opt(f, "temperature", prefix, float, minimum=0.0)
    out["top_p"] = top_p = opt(f, "top_p", prefix, float)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"{prefix}top_p must be in (0, 1], got {top_p}", prefix + "top_p")
    top_k = opt(f, "top_k", prefix, int, minimum=-1)
    out["top_k"] = 0 if top_k == -1 else top_k
    seed_key = "sampling_seed" if f.get("sampling_seed") is not None else "seed"
    out["seed"] = opt(f, seed_key, prefix, int, minimum=0, maximum=MAX_SEED - 1)
    out["ignore_eos"] = bool(opt(f, "ignore_eos", prefix, bool))
    out["stop"] = _stop(f.get("stop"), prefix + "stop", at.max_stop)
    out["stop_token_ids"] = tuple(token_ids(f.get("stop_token_ids"), prefix + "stop_token_ids", vocab_size,
                                            allow_empty=True, max_count=MAX_STOP_TOKEN_IDS) or ())
    out["presence_penalty"] = opt_range(f, "presence_penalty", prefix, -2.0, 2.0) or 0.0
    out["frequency_penalty"] = opt_range(f, "frequency_penalty", prefix, -2.0, 2.0) or 0.0
    repetition = opt_range(f, "repetition_penalty", prefix, 0.0, 2.0, open_below=True) \
        if endpoint == "generate" else None
    out["repetition_penalty"] = repetition if repetition is not None else 1.0
    out["logit_bias"] = _logit_bias(f.get("logit_bias"), vocab_size) if endpoint != "generate" else ()
    return out


def include_usage(body: dict, endpoint: str, stream: bool) -> bool:
    """``stream_options.include_usage``: only on the OpenAI routes, only with ``stream``."""
    if body.get("stream_options") is None:
        return False
    if endpoint == "generate":
        raise InvalidRequest("stream_options is not supported by /generate", "stream_options")
    v = body["stream_options"]
    if not isinstance(v, dict):
        raise InvalidRequest(f"stream_options must be an object, not {type_name(v)}", "stream_options")
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    for key in v:
        if key != "include_usage":
            raise InvalidRequest(f"unrecognized request field `stream_options.{key}`", f"stream_options.{key}")
    return bool(opt(v, "include_usage", "stream_options.", bool))


def logprobs(body: dict, endpoint: str) -> Optional[int]:
    """How many alternatives per token the request wants logprobs for; None: no logprobs."""
    if endpoint == "completions":
        return opt(body, "logprobs", "", int, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if endpoint == "chat":
        on, top_key = opt(body, "logprobs", "", bool), "top_logprobs"
    else:
        on, top_key = opt(body, "return_logprob", "", bool), "top_logprobs_num"
    k = opt(body, top_key, "", int, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if k and not on:
        flag = "logprobs" if endpoint == "chat" else "return_logprob"
        raise InvalidRequest(f"{top_key} needs {flag}: true", top_key)
    return (k or 0) if on else None


def sampling_params(values: dict[str, Any], defaults: dict, **rest: Any) -> SamplingParams:
    """``SamplingParams`` of :func:`sampling`'s values, the model's generation defaults (else
    the API's) where the client gave none, and ``rest``."""
    return SamplingParams(**{
        **values, **rest,
        "temperature": _pick(values["temperature"], defaults.get("temperature"), 1.0),
        "top_p": _pick(values["top_p"], defaults.get("top_p"), 1.0),
        "top_k": int(_pick(values["top_k"], defaults.get("top_k"), 0)),
    })


def _pick(value, default, fallback):
    if value is not None:
        return value
    return default if default is not None else fallback


def _logit_bias(v: Any, vocab_size: Optional[int]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object of token id (a string of digits) to a number in
    [-100, 100], at most :data:`MAX_LOGIT_BIAS` of them; as sorted (token, bias) pairs."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidRequest(f"logit_bias must be an object of token id to bias, not {type_name(v)}", "logit_bias")
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
            raise InvalidRequest(f"{name} must be a finite number, not {type_name(bias)}", "logit_bias")
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
