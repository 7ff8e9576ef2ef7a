"""What a decode's ``RegisterRoom`` must say of a prefill room before prefill acts on it (every
field from the network is untrusted): the same prompt length, a cached prefix of whole pages
shorter than the prompt (``docs/prefix_cache.md``), and enough pages for the rest."""

from __future__ import annotations

from splitserve.disagg import protocol


def registration_problem(prompt_len: int, n_pages: int, page_size: int, msg: protocol.RegisterRoom) -> str:
    """Why ``msg`` cannot register a room of ``prompt_len`` tokens in ``n_pages`` pages; "" if it can."""
    if msg.prompt_len != prompt_len:
        return f"prompt length differs: {prompt_len} tokens here, {msg.prompt_len} at decode"
    skip, extra = divmod(msg.cached_tokens, page_size)
    if extra or not 0 <= skip < n_pages:
        return f"decode holds a cached prefix of {msg.cached_tokens} tokens, not whole pages of a prompt of {prompt_len}"
    if len(msg.pages) < n_pages - skip:
        return f"decode registered {len(msg.pages)} pages, the prompt needs {n_pages - skip} after its cached prefix"
    return ""
