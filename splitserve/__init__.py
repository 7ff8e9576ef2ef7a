"""splitserve: an LLM server with disaggregated prefill and decode (see docs/design.md)."""

__version__ = "0.1.0"
