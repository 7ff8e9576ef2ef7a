"""``splitserve top``: a live terminal view of a deployment (rich).

The workers are found through routers (``--router URL``: their ``GET /workers``) and/or named
(``--worker URL``). Every ``--interval`` seconds each worker is asked, at once and each within
:data:`ASK_TIMEOUT_S`, for ``/metrics`` and ``/debug/requests`` (neither waits on its engine
loop), and the screen shows per worker its role, health, requests by state, KV usage, peers,
outcome rates and engine-loop age, and the oldest live requests of all workers (one past half its
deadline in red). ``--once`` prints one frame and exits; otherwise the view refreshes until Ctrl-C.

On a keyed deployment top sends the operators' key (``--admin-api-key``, ``--admin-api-key-file``
or ``$SPLITSERVE_ADMIN_API_KEY``) to the routers and the workers alike: it opens ``/workers``,
``/metrics`` and ``/debug/requests`` everywhere (``docs/security.md``). ``splitserve launch``
(whose workers are always keyed) writes the one it draws to a file and names it in its summary.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from splitserve.auth import ADMIN_API_KEY_ENV, bearer, load_key
from splitserve.metrics import parse_exposition

ASK_TIMEOUT_S = 2.0
OLDEST_ROWS = 12
PEER_LINES = 3  # per worker, the most silent peers first


@dataclass
class WorkerView:
    url: str
    role: str = "?"
    in_rotation: Optional[bool] = None  # the router's health view; None when not known through a router
    router_error: Optional[str] = None
    samples: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    error: Optional[str] = None
    rates: dict = field(default_factory=dict)  # (outcome, reason) -> per second since the last poll


MAX_ANSWER_BYTES = 16 << 20  # a worker's /metrics and /debug/requests are far smaller


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is an answer, never followed: the operators' key goes to the URL asked and nowhere else."""

    def redirect_request(self, *args, **kwargs):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _get(url: str, headers: Optional[dict] = None, timeout: float = ASK_TIMEOUT_S, opener=_OPENER) -> bytes:
    """``url``'s body (a redirect is an HTTPError; more than ``MAX_ANSWER_BYTES`` a ValueError)."""
    with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        body = resp.read(MAX_ANSWER_BYTES + 1)
    if len(body) > MAX_ANSWER_BYTES:
        raise ValueError(f"its answer is larger than {MAX_ANSWER_BYTES} bytes")
    return body


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    reason = getattr(exc, "reason", None)
    return f"{type(exc).__name__}: {reason or exc}"


class Top:
    """Polls the deployment; :meth:`render` draws what the last poll saw."""

    def __init__(self, routers: list[str], workers: list[str], rows: int = OLDEST_ROWS, key: Optional[str] = None):
        self.headers = bearer(key) if key else {}  # the operators' key, to routers and workers alike
        self.routers = [u.rstrip("/") for u in routers]
        self.named = [u.rstrip("/") for u in workers]
        self.rows = rows
        self.views: dict[str, WorkerView] = {}
        self.router_errors: dict[str, str] = {}
        self._last: Optional[tuple[float, dict]] = None  # when, {url: {(outcome, reason): count}}
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="top")
        self.polled_at = 0.0

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def poll(self) -> None:
        views: dict[str, WorkerView] = {}
        self.router_errors = {}
        for router, answer in zip(self.routers, self._pool.map(self._router_workers, self.routers)):
            if isinstance(answer, str):
                self.router_errors[router] = answer
                continue
            for w in answer:
                view = views.setdefault(w["url"], WorkerView(w["url"], w["role"]))
                view.in_rotation = bool(w["healthy"]) if view.in_rotation is None else view.in_rotation and w["healthy"]
                view.router_error = w.get("error") or view.router_error
        for url in self.named:
            views.setdefault(url, WorkerView(url))
        list(self._pool.map(self._fill, views.values()))
        now = time.monotonic()
        counts = {url: _outcomes(v.samples) for url, v in views.items() if not v.error}
        if self._last is not None:
            then, before = self._last
            for url, c in counts.items():
                if url in before:
                    views[url].rates = {k: (n - before[url].get(k, 0)) / max(now - then, 1e-6) for k, n in c.items()}
        self._last = (now, counts)
        self.views, self.polled_at = views, time.time()

    def _router_workers(self, router: str):
        try:
            return json.loads(_get(router + "/workers", self.headers))["workers"]
        except Exception as exc:
            return _describe(exc)

    def _fill(self, view: WorkerView) -> None:
        try:
            view.samples = parse_exposition(_get(view.url + "/metrics", self.headers).decode("utf-8"))
            view.rows = json.loads(_get(view.url + "/debug/requests", self.headers))
        except Exception as exc:
            view.error = _describe(exc)
            return
        if view.role == "?":
            roles = {dict(labels).get("role") for (name, labels) in view.samples if name == "splitserve_queue_requests"}
            view.role = next(iter(roles - {None}), "?")

    # -- drawing ----------------------------------------------------------------------------------

    def render(self):
        head = Text(f"splitserve top   {time.strftime('%H:%M:%S', time.localtime(self.polled_at))}   "
                    f"{len(self.views)} workers   routers: {', '.join(self.routers) or '-'}", style="bold")
        parts = [head]
        for router, error in self.router_errors.items():
            parts.append(Text(f"router {router}: {error}", style="bold red"))
        parts += [self._workers_table(), self._requests_table()]
        return Group(*parts)

    def _workers_table(self) -> Table:
        t = Table(title="workers", title_justify="left", expand=True)
        for col in ("worker", "role", "health", "requests by state", "late", "KV", "peers", "outcomes /s", "loop"):
            t.add_column(col, overflow="fold")
        for url, v in sorted(self.views.items(), key=lambda kv: (kv[1].role, kv[0])):
            if v.error:
                t.add_row(url, v.role, Text(f"unreachable: {v.error}", style="bold red"), "", "", "", "", "", "")
                continue
            s = v.samples
            late = sum(n for (name, _), n in s.items() if name == "splitserve_requests_late")
            t.add_row(url, v.role, self._health(v), _states(s), Text(str(int(late)), style="bold red" if late else ""),
                      _kv(s), _peers(s), _rates(v.rates), f"{_value(s, 'splitserve_engine_loop_age_seconds'):.1f}s")
        return t

    @staticmethod
    def _health(v: WorkerView) -> Text:
        if v.in_rotation is False:
            return Text(f"out of rotation: {v.router_error or ''}", style="bold red")
        if _value(v.samples, "splitserve_ready") != 1:
            return Text("not ready", style="yellow")
        return Text("ok" if v.in_rotation else "ok (no router)", style="green")

    def _requests_table(self) -> Table:
        rows = [(url, r) for url, v in self.views.items() for r in v.rows if r.get("holding") is None]
        rows.sort(key=lambda ur: -ur[1].get("age_s", 0))
        t = Table(title=f"oldest live requests ({len(rows)} live)", title_justify="left", expand=True)
        for col in ("worker", "rid", "room", "state", "age", "in state", "left", "peer"):
            t.add_column(col, overflow="fold")
        for url, r in rows[: self.rows]:
            style = "bold red" if r.get("late") else ""
            state = r["state"] + (" LATE" if r.get("late") else "")
            t.add_row(url, str(r.get("rid")), str(r.get("room") or "-"), state, _secs(r.get("age_s")),
                      _secs(r.get("state_age_s")), _secs(r.get("deadline_s")), str(r.get("peer") or "-"), style=style)
        return t


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), float("nan"))


def _secs(v) -> str:
    return f"{v:.1f}s" if isinstance(v, (int, float)) else "-"


def _states(s: dict) -> str:
    parts = [f"{dict(ls)['queue']} {int(n)}" for (name, ls), n in sorted(s.items(), key=lambda kv: sorted(kv[0][1]))
             if name == "splitserve_queue_requests"]
    return "  ".join(parts)


def _kv(s: dict) -> str:
    total, free = _value(s, "splitserve_kv_pages_total"), _value(s, "splitserve_kv_pages_free")
    cached = _value(s, "splitserve_kv_pages_cached")
    cached = cached if cached == cached else 0  # a worker without the prefix cache's metrics
    usage = next((n for (name, _), n in s.items() if name == "splitserve_kv_usage_ratio"), float("nan"))
    if total != total:
        return "-"
    # usage is what requests hold (quarantined pages too); cached pages are reclaimable and shown apart
    text = f"{usage:.0%} ({int(total - free - cached)}/{int(total)} pages)"
    text += f", {int(cached)} cached" if cached else ""
    quarantined = _value(s, "splitserve_kv_pages_quarantined")
    return text + (f", {int(quarantined)} quarantined" if quarantined == quarantined and quarantined else "")


def _peers(s: dict) -> str:
    live = sum(n for (name, ls), n in s.items() if name == "splitserve_peers" and ("state", "live") in ls)
    lost = sum(n for (name, ls), n in s.items() if name == "splitserve_peers" and ("state", "lost") in ls)
    if not any(name == "splitserve_peers" for name, _ in s):
        return "-"
    silences = sorted(((n, dict(ls)["peer"]) for (name, ls), n in s.items()
                       if name == "splitserve_peer_silence_seconds"), reverse=True)
    lines = [f"{int(live)} live, {int(lost)} lost"]
    lines += [f"{peer.partition('#')[0]} silent {n:.1f}s" for n, peer in silences[:PEER_LINES]]
    if len(silences) > PEER_LINES:
        lines.append(f"+{len(silences) - PEER_LINES} more")
    return "\n".join(lines)


def _outcomes(s: dict) -> dict:
    return {(dict(ls)["outcome"], dict(ls)["reason"]): n for (name, ls), n in s.items()
            if name == "splitserve_requests_total"}


def _rates(rates: dict) -> str:
    if not rates:
        return "-"
    finished = sum(r for (outcome, _), r in rates.items() if outcome == "finished")
    parts = [f"ok {finished:.1f}"] + [f"{reason} {r:.1f}" for (outcome, reason), r in sorted(rates.items())
                                      if outcome != "finished" and r > 0]
    return "  ".join(parts)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--router", action="append", default=[], metavar="URL",
                    help="a router whose workers to show (its GET /workers); repeat for several")
    ap.add_argument("--worker", action="append", default=[], metavar="URL",
                    help="a worker to show besides those of the routers; repeat for several")
    ap.add_argument("--interval", type=float, default=0.5,
                    help="seconds between polls (default: 0.5: a request turning late is on screen within 1 s; "
                         "bench/top.py measures it)")
    ap.add_argument("--rows", type=int, default=OLDEST_ROWS,
                    help=f"oldest live requests shown (default: {OLDEST_ROWS})")
    ap.add_argument("--once", action="store_true", help="print one frame and exit")
    ap.add_argument("--admin-api-key", default=None, metavar="KEY",
                    help="the operators' key of a keyed deployment, sent to routers and workers (`ps` shows a "
                         f"command line: prefer --admin-api-key-file or ${ADMIN_API_KEY_ENV})")
    ap.add_argument("--admin-api-key-file", default=None, metavar="PATH",
                    help="a file whose first line is the operators' key")


def main(args: argparse.Namespace) -> int:
    if not args.router and not args.worker:
        print("splitserve top: name at least one --router URL or --worker URL")
        return 2
    if not args.interval > 0:
        print("splitserve top: --interval must be a positive number of seconds")
        return 2
    try:
        key = load_key(args.admin_api_key, args.admin_api_key_file, ADMIN_API_KEY_ENV, "--admin-api-key")
    except ValueError as exc:
        print(f"splitserve top: {exc}")
        return 2
    top = Top(args.router, args.worker, args.rows, key)
    console = Console()
    try:
        top.poll()
        if args.once:
            console.print(top.render())
            return 0
        with Live(top.render(), console=console, screen=True, auto_refresh=False) as live:
            due = time.monotonic()
            while True:  # a poll every --interval from the last one's start; a slow poll delays the next, no burst
                due = max(due + args.interval, time.monotonic())
                time.sleep(max(0.0, due - time.monotonic()))
                top.poll()
                live.update(top.render(), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        top.close()
