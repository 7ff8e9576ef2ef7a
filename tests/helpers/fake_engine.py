"""``FakeEngine``: a scripted engine with no model, for the worker's HTTP front end in process;
``FullFakeEngine``: the same with what ``/debug/requests``, ``/flush_cache`` and ``/metrics`` ask."""

from __future__ import annotations

import asyncio
import types

from splitserve.config import EngineConfig
from splitserve.engine.engine import EngineStats
from splitserve.engine.io import NotReady, Overloaded, RequestOutput
from splitserve.engine.worker_stats import WorkerStats
from splitserve.outcomes import Ending, Reason


class FakeEngine:
    """Answers each request by echoing its prompt tokens, one every ``delay`` seconds, until
    ``max_tokens`` ("length"). Scripts in the prompt text: ``FAIL`` fails the request with HTTP 503
    after two tokens; ``RAISE`` makes ``submit`` raise a RuntimeError (a bug)."""

    def __init__(self, tokenizer, delay: float = 0.0, capacity: int = 100):
        self.tokenizer = tokenizer
        self.spec = types.SimpleNamespace(name="fake", path="/models/fake", architecture="FakeForCausalLM",
                                          max_context=256, vocab_size=len(tokenizer), eos_token_ids=(257,),
                                          generation_defaults={}, dtype="torch.float32")
        self.config = EngineConfig()
        self.ready, self.draining = True, False
        self.delay, self.capacity = delay, capacity
        self.live: dict[str, bool] = {}  # rid -> abort requested
        self.aborted: list[str] = []
        self.submitted = 0

    def submit(self, req):
        if not self.ready or self.draining:
            raise NotReady("not ready")
        if len(self.live) >= self.capacity:
            raise Overloaded("the waiting queue is full")
        text = self.tokenizer.decode(req.prompt_ids)
        if "RAISE" in text:
            raise RuntimeError("a bug in submit")
        self.submitted += 1
        self.live[req.rid] = False
        return self._run(req, text)

    async def _run(self, req, text):
        n_prompt = len(req.prompt_ids)
        try:
            for i in range(req.sampling.max_tokens):
                await asyncio.sleep(self.delay)
                if self.live.get(req.rid):
                    yield RequestOutput.ended(req.rid, Ending(Reason.CLIENT_ABORT))
                    return
                if "FAIL" in text and i == 2:
                    yield RequestOutput(req.rid, finished=True, error="the peer was lost", reason=Reason.NOT_READY,
                                        prompt_tokens=n_prompt, completion_tokens=i)
                    return
                tok = req.prompt_ids[i % n_prompt]
                last = i == req.sampling.max_tokens - 1
                yield RequestOutput(req.rid, token_ids=(tok,), text=self.tokenizer.decode([tok]), finished=last,
                                    finish_reason="length" if last else None, prompt_tokens=n_prompt,
                                    completion_tokens=i + 1)
        finally:
            self.live.pop(req.rid, None)

    def abort(self, rid):
        self.aborted.append(rid)
        if rid in self.live:
            self.live[rid] = True

    def stats(self) -> WorkerStats:
        return WorkerStats(EngineStats(pages_free=8, pages_total=8, pages_cached=0, pages_owned=0, waiting=0,
                                       running=len(self.live), preemptions=0, cache_hit_tokens=0,
                                       prompt_tokens_computed=0, cache_evictions=0, unschedulable_steps=0))

    def begin_drain(self):
        self.draining = True

    def shutdown(self):
        self.ready = False


class FullFakeEngine(FakeEngine):
    """The fake engine, with what /debug/requests, /flush_cache and /metrics ask of
    it (``role``: where a prefill or decode worker's metrics hang their counters)."""

    role = types.SimpleNamespace()

    def debug_requests(self):
        return []

    def flush_cache(self):
        return 0
