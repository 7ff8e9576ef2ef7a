"""Request validation: one function, :func:`validate_request`, for every endpoint and every process.

The worker calls it with a :class:`RequestContext` of its tokenizer and model limits and gets token
ids back; the router calls it without one (checks of types, ranges and fields only) before it
picks workers. Both therefore refuse the same requests with the same messages: an
``InvalidRequest`` (400; 404 for another ``model``) whose ``param`` names the offending field. The
fields each endpoint takes and each one's rule are ``validation_fields.FIELDS``;
``docs/requests.md`` writes them out, with the rules that join fields. The modules here hold one
part each: the body, the headers, the sampling fields, the prompt (messages, chat template),
structured output, the bootstrap and router fields, and the readers of one value.
"""

from splitserve.validation.bootstrap import MAX_ROOM
from splitserve.validation.body import check_text, parse_json_body
from splitserve.validation.chars_per_token import MAX_COMPOSED, max_chars_per_token
from splitserve.validation.headers import (
    DEADLINE, MAX_DEADLINE_S, REQUEST_ID, check_deadline, check_request_id, one_header,
)
from splitserve.validation.messages import CHAT_ROLES
from splitserve.validation.request import ENDPOINTS, ROUTER, RequestContext, ValidatedRequest, validate_request
from splitserve.validation.sampling import (
    MAX_N, MAX_OPENAI_STOP, MAX_SEED, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS,
)
from splitserve.validation.template import renders_tools

__all__ = [
    "CHAT_ROLES", "DEADLINE", "ENDPOINTS", "MAX_COMPOSED", "MAX_DEADLINE_S", "MAX_N", "MAX_OPENAI_STOP", "MAX_ROOM",
    "MAX_SEED", "MAX_STOP", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "REQUEST_ID", "ROUTER", "RequestContext",
    "ValidatedRequest", "check_deadline", "check_request_id", "check_text", "max_chars_per_token",
    "one_header", "parse_json_body", "renders_tools", "validate_request",
]
