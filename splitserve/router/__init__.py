"""The router: one OpenAI-compatible endpoint in front of prefill and decode workers.

Per request it validates the body once (the workers' own ``validate_request``, without a
tokenizer), decides whether to split it (``split.py``), draws a random 63-bit
``bootstrap_room``, picks a healthy prefill and decode worker by policy, sends the body with the
bootstrap fields added to both at once, and streams the decode worker's answer back (SGLang's PD
convention, so either side can be swapped for SGLang's).

- ``workers.py``: each worker as the router sees it, and the checker; ``policy.py``: the policies.
- ``proxy.py``: one request; ``attempts.py``: its attempts and what follows a failed one;
  ``exchange.py``: one attempt's legs and which answer the client gets; ``split.py``: split or
  decode alone; ``retry.py``: what is tried again, and the budget.
- ``legs.py``: one leg and its bounds; ``stream.py``: decode's SSE stream, read ahead before the
  commit; ``client.py``: the client's body, read bounded.
- ``metrics.py``: ``splitserve_router_*`` metrics; ``outcomes.py``: how a request ends;
  ``app.py``: the aiohttp app and the process.
"""

from splitserve.router.app import create_app, run_router

__all__ = ["create_app", "run_router"]
