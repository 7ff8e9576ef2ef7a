"""splitserve: an LLM server with disaggregated prefill and decode (see ../shared/DESIGN.md)."""

__version__ = "0.1.0"
