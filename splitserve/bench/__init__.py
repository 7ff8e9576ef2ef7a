"""``splitserve bench``: a serving benchmark against any OpenAI-compatible endpoint.

``workload.py`` makes the requests (random prompts, or multi-turn agentic sessions), ``client.py``
sends one and records when each event arrived, ``load.py`` drives a load (Poisson at a fixed rate,
or closed loop at a concurrency) after a warm-up, ``stats.py`` turns the recorded times into
TTFT/ITL/TPOT/e2e percentiles, throughput and goodput, ``plots.py`` draws them, ``cli.py`` is the
command.
"""
