"""The router's shared state: :class:`RouterState`, one per app, which every handler, attempt and
exchange reads (``state``), and :meth:`RouterState.plan`, which picks a request's workers or says
why there are none (a :class:`~splitserve.router.outcomes.Refusal`).

It sits below the modules that take it (``proxy.py``, ``attempts.py``, ``exchange.py``,
``membership.py``) so that they can name its type without an import cycle."""

from __future__ import annotations

import asyncio
import functools
import secrets
from typing import NamedTuple, Optional, Union

import aiohttp

from splitserve.config import RouterConfig
from splitserve.http_util import ConnectionCap
from splitserve.metrics import Registry
from splitserve.router import split
from splitserve.router.discovery import Discovery
from splitserve.router.metrics import RouterMetrics
from splitserve.router.outcomes import Refusal
from splitserve.router.policy import CacheKnobs, Policy, make_policy
from splitserve.router.recent import RecentRequests
from splitserve.router.retry import RetryBudget
from splitserve.router.worker_trust import RouterKeys
from splitserve.router.workers import DECODE, PREFILL, HealthChecker, Worker, WorkerSet

ROOM_BITS = 63  # a bootstrap_room is a positive 63-bit id; negative ones are a worker's own


class Plan(NamedTuple):
    """Where a request goes: a pair (``prefill`` set) or a decode worker alone, and why."""

    prefill: Optional[Worker]
    decode: Worker
    decision: str  # split.DECISIONS


class RouterState:
    """Everything the handlers share."""

    def __init__(self, config: RouterConfig, registry: Registry, keys: Optional[RouterKeys] = None):
        self.config = config
        self.keys = keys or RouterKeys.of(config)
        self.workers = WorkerSet.from_config(config)
        knobs = CacheKnobs(config.cache_block_chars, config.cache_threshold, config.cache_balance_abs,
                           config.cache_balance_rel, config.cache_index_blocks)
        self.policies: dict[str, Policy] = {role: make_policy(config.policy, knobs) for role in (PREFILL, DECODE)}
        self.workers.on_remove.extend(policy.forget for policy in self.policies.values())
        self.registry = registry
        self.metrics = RouterMetrics(registry, self.workers)
        self.recent = RecentRequests()
        self.retry_budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_min,
                                        config.retry_budget_window_s)
        self.session: Optional[aiohttp.ClientSession] = None  # set at startup (needs the running loop)
        self.checker: Optional[HealthChecker] = None  # likewise
        self.discovery = Discovery(self, registry)  # started at startup when --discovery is given
        self.background: set[asyncio.Task] = set()
        self.refusals = 0  # requests refused for want of a worker (their log lines are sparse)
        self.connections: Optional[ConnectionCap] = None  # set by create_app
        self.worker_ssl = None  # the ssl.SSLContext for https:// workers, if configured
        self.new_room = functools.partial(secrets.randbits, ROOM_BITS)
        """Draws each request's ``bootstrap_room`` (the simulator draws from its seed)."""

    def plan(self, key: str, tokens: int, exclude: Optional[dict] = None, retrying: bool = False,
             one_worker: bool = False) -> Union[Plan, Refusal]:
        """Where a request of about ``tokens`` prompt tokens whose routing key is ``key`` goes, none
        of its workers in ``exclude``: split (a pair, :meth:`pick_workers`) when its uncached part
        reaches ``--pd-threshold-tokens``, else a decode worker alone (``split.py``; always alone
        when it runs on ``one_worker``, ``split.one_worker``); ``fallback``, alone, when it was to
        be split and no prefill is there to pair with (unless ``--no-pd-fallback``). A
        :class:`Refusal` (why) when there is none to go to."""
        decodes = self.workers.candidates(DECODE, exclude)
        if not decodes:
            return self._refused(key, exclude)  # the refusal, as a pair's would be
        cached = split.known_cached_tokens(self.policies[DECODE], decodes, key, tokens)
        decision = split.decide(self.config.pd_threshold_tokens, tokens, cached, one_worker)
        if decision == "split":
            if self.workers.has_pair(exclude):
                picked = self.pick_workers(key, exclude)
                if not isinstance(picked, Refusal):
                    return Plan(picked[0], picked[1], "split")
            if not self.config.pd_fallback:
                return self._refused(key, exclude)  # why there is no pair
            decision = "fallback"
        return Plan(None, self.policies[DECODE].pick(decodes, key), decision)

    def _refused(self, key: str, exclude: Optional[dict]) -> Refusal:
        """Why there is no pair (asked only when there is none: ``WorkerSet.has_pair``)."""
        picked = self.pick_workers(key, exclude)
        assert isinstance(picked, Refusal), "a pair where none was expected"
        return picked

    def can_pick(self, exclude: Optional[dict] = None) -> bool:
        """Whether :meth:`pick_workers` would find a pair with ``exclude``."""
        return self.workers.has_pair(exclude)

    def pick_workers(self, key: str = "", exclude: Optional[dict] = None) -> Union[tuple[Worker, Worker], Refusal]:
        """A (prefill, decode) pair by the policy among healthy workers (each role chosen on its
        own, among those that pair: ``WorkerSet.pick_pair``), for a request whose routing key is
        ``key``, but none in ``exclude`` (role -> the workers that failed the request being
        retried); or why there is none."""
        return self.workers.pick_pair(self.policies, key, exclude)

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` in the background, owned by the app (cancelled at cleanup)."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task
