"""What one seed runs: the cluster's settings, the load, and the faults — all drawn from the seed.

A scenario is **quiet** (about one seed in four: only faults the system is meant to mask —
control frames dropped, duplicated, delayed and reordered, transfer notifications lost — so every
request whose client stays must finish) or **chaos** (those plus every fault that may fail the
requests it touches: kill -9 and restart, partitions that heal, wedged engine loops, hung and
crashing threads, failing forward passes, failing, stalled and late writes, calls into a thread
that raise). About half the chaos seeds also lose a decode worker mid-answer (``decode_lost``: killed,
or stopped and silent for a while, once some tokens of a stream reached its client; drawn from a
stream of their own, so the other faults are the seed's as before): the router is to continue its
requests elsewhere with the same tokens whenever the schedule leaves a way (``losses.py``).

The deadlines are the defaults scaled down (``DEADLINES``): the same rules at a fifth of the time,
so that a seed runs each of them many times. Everything else a seed may vary is a field of
:class:`Scenario`; ``Scenario.draw(seed)`` is the only place randomness enters it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from splitserve.config import EngineConfig, RouterConfig
from splitserve.disagg.lifecycle import Deadlines
from splitserve.sim.clock import stable_seed

DEADLINES = Deadlines(bootstrap_s=12.0, queue_s=12.0, prefill_stall_s=6.0, transfer_floor_s=3.0, transfer_s_per_gib=4.0,
                      write_drain_s=6.0, prealloc_s=9.0, kv_wait_s=15.0, decode_stall_s=6.0, register_resend_s=1.0,
                      quarantine_resend_s=1.0, pending_registration_s=12.0, heartbeat_interval_s=1.0,
                      heartbeat_misses=4, tombstone_s=22.0, request_timeout_s=20.0, reclaim_s=11.0)

# faults that may fail the requests they touch (a request they touch is excused for failing)
FATAL = ("kill", "partition", "wedge", "hang_transfer", "hang_control", "crash_transfer", "crash_control",
         "forward_fail", "edge_error", "write_faults")
# faults the system must mask (never an excuse)
MASKED = ("drop", "duplicate", "reorder", "notify_drop")
LOSS = "decode_lost"  # a decode lost mid-answer: an excuse only where no way to serve is left (losses.py)
LOSS_MODES = ("kill", "stop")  # kill -9 (restarted after the fault's duration), SIGSTOP (for its duration)


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` at ``at`` for ``duration`` seconds, on ``target`` (a worker slot, a
    (prefill, decode) pair of slots, or ``*`` for all)."""

    kind: str
    at: float
    duration: float
    target: object
    params: tuple = ()

    @property
    def end(self) -> float:
        return self.at + self.duration


@dataclass(frozen=True)
class Scenario:
    seed: int
    quiet: bool = False
    prefills: int = 2
    decodes: int = 2
    requests: int = 300
    arrival_s: float = 60.0  # requests arrive over this long
    deadlines: Deadlines = DEADLINES
    loop_stall_s: float = 6.0
    prefill_tokens: int = 512  # KV pool of a prefill worker
    decode_tokens: int = 384
    page_size: int = 4
    max_running: int = 16
    max_waiting: int = 48
    batch_tokens: int = 96
    max_prompt: int = 60
    max_tokens: int = 12
    stream: float = 0.8  # share of streaming clients
    hang_up: float = 0.2  # share of clients that hang up at a random moment
    stop_reading: float = 0.02  # share of streaming clients that stop reading
    sampled: float = 0.1  # share with temperature > 0 (the rest greedy: checked against the reference)
    shared_prefix: float = 0.4  # share of prompts that start with one of the seed's few prefixes
    shared_decode_name: bool = False
    kv_failure_policy: str = "fail"  # decode's --kv-failure-policy
    step_s: float = 0.002
    token_s: float = 0.00005
    eos_every: int = 24
    wake_s: float = 0.001  # a thread wakes this long (at most) after work is handed to it
    tick_s: float = 0.1  # the control and transfer threads' timers are looked at this often
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    notify_drop: float = 0.0
    faults: tuple[Fault, ...] = ()
    resend_off_by: int = 0
    """A plant, never drawn: a continuation's ids as the router sent them, one too few (-1) or one
    too many (+1, the last again), on the simulated wire (``losses.off_by``)."""
    router: dict = field(default_factory=lambda: dict(health_interval_s=1.0, health_failures=2, request_timeout_s=25.0,
                                                      worker_connect_timeout_s=3.0, worker_header_timeout_s=10.0,
                                                      client_write_timeout_s=5.0, client_body_timeout_s=5.0,
                                                      stream_stall_s=6.0, max_migrations=2,
                                                      pd_threshold_tokens=0))  # every request split

    def engine_config(self, kind: str) -> EngineConfig:
        tokens = self.prefill_tokens if kind == "prefill" else self.decode_tokens
        return EngineConfig(model="sim", page_size=self.page_size, max_total_tokens=tokens,
                            max_running_requests=self.max_running, max_waiting_requests=self.max_waiting,
                            max_batch_tokens=self.batch_tokens, chunked_prefill=True, seed=self.seed)

    def router_config(self, prefill, decode) -> RouterConfig:
        return RouterConfig(policy="round_robin", prefill=prefill, decode=decode, **self.router)

    @property
    def end_to_end_s(self) -> float:
        return self.router["request_timeout_s"]

    @classmethod
    def draw(cls, seed: int, requests: int = 300, quiet: bool | None = None,
             kv_failure_policy: str = "fail") -> "Scenario":
        """The seed's scenario; ``kv_failure_policy`` (decode's) draws nothing, so a seed is the
        same cluster, clients and faults under either policy."""
        rng = random.Random(stable_seed("scenario", seed))
        quiet = rng.random() < 0.25 if quiet is None else quiet
        rate = rng.uniform(3.0, 12.0)  # requests per second
        s = cls(seed=seed, quiet=quiet, requests=requests, arrival_s=requests / rate,
                decode_tokens=rng.choice((256, 384, 512, 1024)), prefill_tokens=rng.choice((384, 512, 1024)),
                max_prompt=rng.choice((16, 40, 60)), max_tokens=rng.choice((4, 12, 24)),
                hang_up=rng.uniform(0.05, 0.3), shared_decode_name=rng.random() < 0.5,
                drop=rng.choice((0.0, 0.01, 0.03)), duplicate=rng.choice((0.0, 0.02)),
                reorder=rng.choice((0.0, 0.02, 0.05)), notify_drop=rng.choice((0.0, 0.1, 0.3)),
                eos_every=rng.choice((0, 24)), kv_failure_policy=kv_failure_policy)
        if not quiet:
            faults = _draw_faults(rng, s) + _draw_losses(random.Random(stable_seed("decode_lost", seed)), s)
            s = replace(s, faults=tuple(sorted(faults, key=lambda f: (f.at, f.kind))))
        return s


def _draw_losses(rng: random.Random, s: Scenario) -> list[Fault]:
    """About half the chaos seeds: one to three decodes lost once ``params[1]`` token events of one
    of their streams reached its client (``params[0]``: how, :data:`LOSS_MODES`); a kill's
    duration is its restart's delay, a stop's how long the process stays stopped (past the
    router's ``stream_stall_s`` or not)."""
    if rng.random() < 0.5:
        return []
    out = []
    for _ in range(rng.randint(1, 3)):
        mode = rng.choice(LOSS_MODES)
        duration = rng.uniform(0.5, 8.0) if mode == "kill" else rng.choice((2.0, 8.0, 14.0))
        out.append(Fault(LOSS, rng.uniform(1.0, s.arrival_s), duration, f"decode{rng.randrange(s.decodes)}",
                         (mode, rng.randint(1, 3))))
    return out


def _draw_faults(rng: random.Random, s: Scenario) -> list[Fault]:
    slots = [f"prefill{i}" for i in range(s.prefills)] + [f"decode{i}" for i in range(s.decodes)]
    pairs = [(f"prefill{i}", f"decode{j}") for i in range(s.prefills) for j in range(s.decodes)]
    stall = s.loop_stall_s
    faults = []
    n = rng.randint(2, 8)
    for _ in range(n):
        at = rng.uniform(0.5, s.arrival_s)
        kind = rng.choice(FATAL)
        if kind == "kill":
            faults.append(Fault(kind, at, rng.uniform(0.2, 8.0), rng.choice(slots)))
        elif kind == "partition":
            way = rng.random()  # one draw: a quarter one-way, half of those from decode to prefill
            faults.append(Fault(kind, at, rng.choice((0.5, 2.0, 3.5, 6.0, 15.0)), rng.choice(pairs),
                                (way < 0.25, way < 0.125)))
        elif kind == "wedge":
            faults.append(Fault(kind, at, rng.choice((1.0, 4.0, stall + 4.0, 3 * stall)), rng.choice(slots)))
        elif kind in ("hang_transfer", "hang_control"):  # until the worker is restarted
            faults.append(Fault(kind, at, rng.uniform(stall + 3.0, 3 * stall), rng.choice(slots)))
        elif kind in ("crash_transfer", "crash_control", "forward_fail"):
            faults.append(Fault(kind, at, 0.0, rng.choice(slots)))
        elif kind == "edge_error":
            faults.append(Fault(kind, at, rng.uniform(0.5, 5.0), rng.choice(slots), (rng.choice((0.05, 0.2, 0.5)),)))
        elif kind == "write_faults":
            rates = (rng.choice((0.0, 0.05, 0.2)), rng.choice((0.0, 0.05, 0.2)), rng.choice((0.0, 0.05, 0.2)))
            faults.append(Fault(kind, at, rng.uniform(1.0, 10.0), "*", rates))
    return faults
