"""The router: one OpenAI-compatible endpoint in front of prefill and decode workers.

Per request it validates the body once (the workers' own ``validate_request``, without a
tokenizer), decides whether to split it (a short prompt goes to a decode worker alone, without
bootstrap fields: ``split.py``), draws a random 63-bit ``bootstrap_room``, picks a healthy prefill and decode worker by
policy, sends the body with ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` added (any the
client sent are replaced) to both at once, and streams the decode worker's answer back (SGLang's PD
convention, so either side can be swapped for SGLang's).

- ``workers.py``: the router's view of each worker (health, requests in flight) and the checker.
- ``policy.py``: round_robin, random, least_load.
- ``proxy.py``: one request, from its body to its answer; ``attempts.py``: its attempts, each a
  new room, and what follows a failed one; ``exchange.py``: one attempt's two legs (or decode's
  alone) and the rules for which answer the client gets; ``split.py``: whether a request is split
  or goes to decode alone; ``retry.py``: which failures before the commit are tried again, and
  the retry budget.
- ``legs.py``: one leg (one POST to one worker) and its bounds; ``stream.py``: decode's SSE stream,
  read ahead before the commit; ``client.py``: the client's body, read bounded (the writes to it:
  ``splitserve/client_writer.py``).
- ``metrics.py``: ``splitserve_router_*`` Prometheus metrics; ``outcomes.py``: how a request ends.
- ``app.py``: the aiohttp app (``create_app``) and the process (``run_router``).
"""

from splitserve.router.app import create_app, run_router

__all__ = ["create_app", "run_router"]
