"""A deterministic simulator of a whole cluster (``docs/lifecycle.md``, *The simulator*).

The project's real code — engine loops, roles and their tables, control and transfer threads,
the router's exchanges and health checks, the workers' HTTP handlers — runs in one process on a
virtual-time event loop, with only the edges swapped: the clock, the sockets, the transfer
backend, the forward pass and the HTTP wire. Clients, faults and every random choice come from
one seed, invariants are checked while it runs, and ``python -m splitserve.sim --seed N`` replays
a seed exactly.

Modules: ``clock.py`` (the virtual-time loop, random streams by name), ``model.py`` (the forward
pass, byte tokenizer), ``network.py`` (links, partitions, simulated sockets), ``transfer.py`` (the
transfer network), ``http.py`` (the router's session, requests for the real handlers),
``cluster.py`` (the processes on the loop; kills, restarts, wedges), ``scenario.py`` (what a seed
runs), ``workload.py`` (the clients), ``invariants.py`` (what must hold), ``losses.py`` (a decode
lost mid-answer), ``run.py`` (one seed), ``__main__.py`` (the command line).
"""
