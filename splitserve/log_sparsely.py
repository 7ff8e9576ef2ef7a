"""When a counted thing is worth a log line: a flood of bad frames, refusals or notices must not
become a flood of log lines, yet the first few and then one in many are seen (all are counted)."""

from __future__ import annotations


def worth_logging(count: int, first: int = 20, every: int = 1000) -> bool:
    """Whether the ``count``-th occurrence (from 1) is logged: the first ``first``, then every
    ``every``-th."""
    return count <= first or count % every == 0
