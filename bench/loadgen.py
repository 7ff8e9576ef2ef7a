"""A load generator for OpenAI-compatible servers, after AIPerf's concurrency mode: ``concurrency``
clients, each sending its next streaming ``/v1/completions`` request as soon as its last one ended,
until ``requests`` have been sent. Prompts are random token ids of a fixed length (a new draw per
request, so nothing can be served from a cache), answers have a fixed length (``max_tokens`` with
``ignore_eos``); a request that ends with another token count is an error.

Per request, as AIPerf defines them: TTFT, the time from sending to the first SSE chunk with text;
ITL, ``(latency - TTFT) / (output tokens - 1)``; latency, sending to ``[DONE]``. Output tokens
come from the final usage chunk (``stream_options.include_usage``), not from counting chunks.
Throughput is completed requests (or their output tokens) over the wall time from the first send
to the last answer. ``warmup`` requests are run first, one per client, and not counted.

    summary = asyncio.run(run_load("http://127.0.0.1:8000", Load(concurrency=8)))
    print(summary.request_throughput, summary.ttft_ms(50))
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp
import numpy as np


@dataclass(frozen=True)
class Load:
    concurrency: int = 8
    """Requests in flight at once."""
    requests: int = 64
    """Requests counted (after the warm-up)."""
    prompt_tokens: int = 512
    output_tokens: int = 48
    warmup: int = 8
    token_ids: tuple[int, int] = (10, 2000)
    """Prompt token ids are drawn uniformly from [low, high)."""
    seed: int = 0
    timeout_s: float = 600.0


@dataclass(frozen=True)
class Record:
    ttft_s: float
    latency_s: float
    output_tokens: int
    error: Optional[str] = None

    @property
    def itl_s(self) -> float:
        return (self.latency_s - self.ttft_s) / max(self.output_tokens - 1, 1)


@dataclass(frozen=True)
class Summary:
    load: Load
    duration_s: float
    records: list[Record] = field(repr=False)

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.error is None]

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.records if r.error is not None]

    @property
    def request_throughput(self) -> float:
        return len(self.ok) / self.duration_s

    @property
    def output_throughput(self) -> float:
        return sum(r.output_tokens for r in self.ok) / self.duration_s

    def ttft_ms(self, q: float) -> float:
        return _percentile([r.ttft_s for r in self.ok], q) * 1e3

    def itl_ms(self, q: float) -> float:
        return _percentile([r.itl_s for r in self.ok], q) * 1e3

    def latency_ms(self, q: float) -> float:
        return _percentile([r.latency_s for r in self.ok], q) * 1e3


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], load: Load) -> Record:
    body = {"prompt": prompt, "max_tokens": load.output_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens, done = None, None, False
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Record(0.0, time.perf_counter() - t0, 0, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if ttft is None and any(c.get("text") for c in event.get("choices") or ()):
                    ttft = time.perf_counter() - t0
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Record(0.0, time.perf_counter() - t0, 0, f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - t0
    if not done or ttft is None or tokens != load.output_tokens:
        return Record(ttft or 0.0, latency, tokens or 0,
                      f"incomplete answer: [DONE] {done}, first text {ttft is not None}, "
                      f"{tokens} tokens (want {load.output_tokens})")
    return Record(ttft, latency, tokens)


async def run_load(url: str, load: Load) -> Summary:
    """Warm up, then run ``load.requests`` requests at ``load.concurrency`` against ``url``."""
    rng = random.Random(load.seed)
    prompts = [[rng.randrange(*load.token_ids) for _ in range(load.prompt_tokens)]
               for _ in range(load.warmup + load.requests)]
    connector = aiohttp.TCPConnector(limit=load.concurrency)
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        await asyncio.gather(*(one_request(session, url, p, load) for p in prompts[:load.warmup]))
        todo = iter(prompts[load.warmup:])
        records: list[Record] = []

        async def client() -> None:
            for prompt in todo:  # shared: each client takes the next prompt when it is free
                records.append(await one_request(session, url, prompt, load))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(load.concurrency)))
        return Summary(load, time.perf_counter() - t0, records)
