"""A deterministic simulator of a whole cluster (``docs/lifecycle.md``, *The simulator*).

The project's real code — engine loops, roles and their tables, control and transfer threads,
the router's exchanges and health checks, the workers' HTTP handlers — runs in one process on a
virtual-time event loop, with only the edges swapped: the clock, the sockets, the transfer
backend, the forward pass and the HTTP wire. Clients, faults and every random choice come from
one seed, invariants are checked while it runs, and ``python -m splitserve.sim --seed N`` replays
a seed exactly.

| module | what |
|---|---|
| ``clock.py`` | the virtual-time asyncio loop, random streams per name |
| ``model.py`` | the fake forward pass, byte tokenizer |
| ``network.py`` | links, partitions, the control plane's simulated sockets |
| ``transfer.py`` | the simulated transfer network behind the fake backend |
| ``http.py`` | the router's simulated session, requests for the real handlers |
| ``cluster.py`` | worker processes and the router on the loop; kills, restarts, wedges |
| ``scenario.py`` | what a seed runs: settings, load, faults |
| ``workload.py`` | the clients and their endings |
| ``invariants.py`` | what must hold |
| ``losses.py`` | a decode lost mid-answer, and what its requests must end with |
| ``run.py`` | one seed, start to end |
| ``__main__.py`` | the command line |
"""
