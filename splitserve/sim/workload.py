"""The clients: they arrive on the seed's schedule, send one completion each through the real
router, stream or not, and some hang up — before their headers, mid-stream, after the end — or
stop reading. Each records what it saw, and its one ending.

A client's **ending** is what it can tell: ``finished`` (a whole answer: 200 and, streaming,
``data: [DONE]`` with no error event), ``error:<code>`` (an error status or event, with its
OpenAI error code), ``hung_up`` (it left before the end), ``stopped_reading`` (it stopped reading
and the router cut it off), or ``none`` (nothing yet: a violation once it is past its deadline).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from splitserve.sim.http import Sink, Transport, request
from splitserve.sim.model import EOS, ByteTokenizer, chain, chain_step, next_token

CURRENT = contextvars.ContextVar("sim_client", default=None)  # the client whose request the router handles
_ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.!?0123456789"


@dataclass
class ClientSpec:
    n: int
    at: float
    prompt: str
    max_tokens: int
    stream: bool
    temperature: float
    hang_up_after: Optional[float]  # seconds after sending
    stop_reading_after: Optional[float]


def draw_clients(rng: random.Random, s) -> list[ClientSpec]:
    clients = []
    t = 0.5
    # a few prefixes many prompts start with (a system prompt, a conversation so far): the prefix
    # cache's pages are shared between rooms on both sides
    prefixes = ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(8, max(8, s.max_prompt // 2))))
                for _ in range(3)]
    for n in range(s.requests):
        t += rng.expovariate(s.requests / s.arrival_s)
        prompt = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, s.max_prompt)))
        if rng.random() < s.shared_prefix:
            prompt = (rng.choice(prefixes) + prompt)[:s.max_prompt + s.max_prompt // 2]
        stream = rng.random() < s.stream
        hang = None
        if rng.random() < s.hang_up:  # at a random moment in every state, early ones most
            hang = rng.choice((0.0, rng.uniform(0, 0.01), rng.uniform(0, 0.1), rng.uniform(0, 1.0), rng.uniform(0, 8)))
        stop = rng.uniform(0, 0.2) if stream and rng.random() < s.stop_reading else None
        temperature = 0.8 if rng.random() < s.sampled else 0.0
        clients.append(ClientSpec(n, t, prompt, rng.randint(1, s.max_tokens), stream, temperature, hang, stop))
    return clients


def reference_text(prompt: str, max_tokens: int, eos_every: int) -> str:
    """What a colocated worker answers a greedy request with: the fake model's tokens alone."""
    ids = ByteTokenizer().encode(prompt)
    key, out = chain(ids)[-1], []
    for _ in range(max_tokens):
        token = next_token(key, eos_every)
        if token == EOS:
            break
        key = chain_step(key, token)
        out.append(token)
    return bytes(out).decode("utf-8")


@dataclass(eq=False)
class Client:
    spec: ClientSpec
    born: float = 0.0
    status: Optional[int] = None
    headers_seen: int = 0
    chunks: list = field(default_factory=list)
    eof: bool = False
    ended_at: Optional[float] = None
    left_at: Optional[float] = None  # hung up or stopped reading
    left: Optional[str] = None
    pair: Optional[tuple[str, str]] = None  # (prefill slot, decode slot) the router picked
    decodes: list = field(default_factory=list)  # the decode slot of each leg the router sent it on, in order
    prefills: list = field(default_factory=list)  # likewise, its prefill legs
    token_events: int = 0  # data events with tokens received (a stream's)
    watch: Optional[Callable[["Client"], None]] = None  # called after each chunk it receives
    refused: bool = False  # the router had no pair to pick
    task: Optional[asyncio.Task] = None
    problems: list = field(default_factory=list)

    @property
    def rid(self) -> str:
        return f"c{self.spec.n}"

    def body(self, model: str) -> bytes:
        s = self.spec
        body = {"model": model, "prompt": s.prompt, "max_tokens": s.max_tokens, "stream": s.stream,
                "temperature": s.temperature, "rid": self.rid}
        if s.temperature:
            body["seed"] = s.n
        return json.dumps(body).encode()

    # -- what it receives ---------------------------------------------------------------------

    def sink(self, loop) -> Sink:
        def headers(status: int, _headers: dict) -> None:
            self.headers_seen += 1
            if self.headers_seen > 1:
                self.problems.append("a second status")
            if self.status is None and self.left is None:
                self.status = status

        def data(chunk: bytes) -> None:
            if self.eof:
                self.problems.append("bytes after the end")
            if self.left is None:
                self.chunks.append(chunk)
                self.token_events += chunk.count(b'"text"')
                if self.watch is not None:
                    self.watch(self)

        def eof() -> None:
            if self.eof:
                self.problems.append("a second end")
            if self.headers_seen == 0:
                self.problems.append("an end without a status")
            if self.left is None:
                self.eof, self.ended_at = True, loop.time()

        return Sink(headers, data, eof)

    def ending(self) -> str:
        if self.eof:
            return self._answer()
        return self.left or "none"

    def _answer(self) -> str:
        body = b"".join(self.chunks)
        if self.status != 200:
            return f"error:{_code(body)}"
        if not self.spec.stream:
            try:
                json.loads(body)["choices"][0]["text"]
            except (ValueError, KeyError, IndexError, TypeError):
                return "error:bad_body"
            return "finished"
        events = _events(body)
        for ev in events:
            if isinstance(ev, dict) and "error" in ev:
                return f"error:{(ev['error'] or {}).get('code')}"
        return "finished" if events and events[-1] == "[DONE]" else "error:truncated"

    def text(self) -> str:
        body = b"".join(self.chunks)
        if not self.spec.stream:
            return json.loads(body)["choices"][0]["text"]
        return "".join(ev["choices"][0].get("text", "") for ev in _events(body)
                       if isinstance(ev, dict) and ev.get("choices"))


def _code(body: bytes) -> Optional[str]:
    try:
        return (json.loads(body).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


def _events(body: bytes) -> list:
    out = []
    for block in body.decode("utf-8", errors="replace").split("\n\n"):
        block = block.strip()
        if not block.startswith("data: "):
            continue
        payload = block[len("data: "):]
        if payload == "[DONE]":
            out.append("[DONE]")
            continue
        try:
            out.append(json.loads(payload))
        except ValueError:
            out.append(None)
    return out


async def run_client(client: Client, router, loop, model: str) -> None:
    """Send the request and stay until the answer ends, or leave as the spec says."""
    s = client.spec
    client.born = loop.time()
    sink = client.sink(loop)
    transport = Transport()
    req = request("POST", "/v1/completions", client.body(model), sink, transport, loop)
    token = CURRENT.set(client)
    try:
        client.task = task = asyncio.ensure_future(router.handle(req))
    finally:
        CURRENT.reset(token)

    def leave(how: str) -> None:
        if client.eof or client.left is not None:
            return
        client.left, client.left_at = how, loop.time()
        if how == "hung_up":
            transport.close()
            if not task.done():
                task.cancel()  # aiohttp cancels the handler of a connection that is lost
        else:
            sink.stalled = True  # the router's next write waits, until its client_write_timeout_s

    if s.hang_up_after is not None:
        loop.call_at(client.born + s.hang_up_after, leave, "hung_up")
    if s.stop_reading_after is not None:
        loop.call_at(client.born + s.stop_reading_after, leave, "stopped_reading")
    try:
        await task
    except asyncio.CancelledError:
        pass
