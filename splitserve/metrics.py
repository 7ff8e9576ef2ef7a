"""A small, dependency-free Prometheus registry (text exposition format 0.0.4).

There is no global registry: each process (worker app, router) creates one :class:`Registry` and
hands it to whoever records metrics, so two apps in one test process never share counters.

Three metric kinds, each with optional labels::

    reg = Registry()
    reqs = reg.counter("splitserve_requests_total", "Requests by outcome.", ["outcome"])
    reqs.labels(outcome="finished").inc()
    lat = reg.histogram("splitserve_request_seconds", "Latency.", buckets=(0.1, 1, 10))
    lat.observe(0.25)
    pages = reg.gauge("splitserve_kv_pages_free", "Free KV pages.",
                      callback=lambda: engine.stats()["pages_free"])
    text = reg.exposition()

A gauge with a ``callback`` is *derived*: the callback runs at scrape time and its answer is the
value, so the number shown is read from the structure that owns the truth (the engine's pools and
queues) instead of being kept in step by hand. A labelled callback returns ``{label values: value}``
(a tuple of values in ``labelnames`` order, or a dict of label name to value); ``None`` means no
value now (the metric shows no samples, quietly). A callback that
raises makes that metric show no samples for this scrape (and is logged once per scrape), it never
breaks ``/metrics``.

Every metric object is thread-safe: one lock per metric guards its children and values.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

LabelValues = tuple[str, ...]
CallbackResult = Union[None, float, int, Mapping[LabelValues, float], Mapping[str, float]]


def _format_value(v: float) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _label_str(names: Sequence[str], values: Sequence[str], extra: Optional[tuple[str, str]] = None) -> str:
    pairs = [f'{n}="{_escape_label(str(v))}"' for n, v in zip(names, values)]
    if extra is not None:
        pairs.append(f'{extra[0]}="{_escape_label(extra[1])}"')
    return "{" + ",".join(pairs) + "}" if pairs else ""


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[LabelValues, object] = {}

    def _key(self, args: tuple, kwargs: dict) -> LabelValues:
        if args and kwargs:
            raise ValueError("pass label values either by position or by name, not both")
        if kwargs:
            if set(kwargs) != set(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(kwargs)}")
            return tuple(str(kwargs[n]) for n in self.labelnames)
        if len(args) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {len(args)} values")
        return tuple(str(a) for a in args)

    def _new_child(self):
        raise NotImplementedError

    def labels(self, *args, **kwargs):
        key = self._key(args, kwargs)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
            return child

    def _unlabelled(self):
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use .labels(...)")
        return self.labels()

    def samples(self) -> list[str]:
        raise NotImplementedError

    def exposition(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        lines.extend(self.samples())
        return "\n".join(lines) + "\n"


class _Value:
    __slots__ = ("_lock", "value")

    def __init__(self):
        self._lock = threading.Lock()
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value -= amount

    def set(self, value: float) -> None:
        with self._lock:
            self.value = value

    def get(self) -> float:
        with self._lock:
            return self.value


class _CounterChild(_Value):
    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        super().inc(amount)


class Counter(_Metric):
    """Monotonic count. ``labels(...).inc(n)``; ``inc()`` directly when it has no labels."""

    kind = "counter"

    def _new_child(self):
        return _CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def get(self, *args, **kwargs) -> float:
        return self.labels(*args, **kwargs).get()

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._children.items())
        return [f"{self.name}{_label_str(self.labelnames, k)} {_format_value(c.get())}" for k, c in items]


class Gauge(_Metric):
    """A value that goes up and down, set by hand (``set``/``inc``/``dec``) or derived from a
    ``callback`` at scrape time (then ``set`` is an error: there is one source of truth)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (),
                 callback: Optional[Callable[[], CallbackResult]] = None):
        super().__init__(name, help, labelnames)
        self.callback = callback

    def _new_child(self):
        if self.callback is not None:
            raise ValueError(f"{self.name} is derived from a callback; it cannot be set")
        return _Value()

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._unlabelled().dec(amount)

    def collect(self) -> dict[LabelValues, float]:
        """Current values by label values (runs the callback, if any)."""
        if self.callback is None:
            with self._lock:
                return {k: c.get() for k, c in self._children.items()}
        result = self.callback()
        if result is None:
            return {}
        if not isinstance(result, Mapping):
            if self.labelnames:
                raise ValueError(f"{self.name} has labels; its callback must return a mapping")
            return {(): float(result)}
        out: dict[LabelValues, float] = {}
        for key, value in result.items():
            if isinstance(key, str):
                key = (key,)
            key = tuple(str(k) for k in key)
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: callback gave labels {key} for {self.labelnames}")
            out[key] = float(value)
        return out

    def samples(self) -> list[str]:
        try:
            values = self.collect()
        except Exception as exc:  # a broken callback hides its metric, never the whole page
            log.warning("metric %s: callback failed: %r", self.name, exc)
            return []
        return [f"{self.name}{_label_str(self.labelnames, k)} {_format_value(v)}" for k, v in sorted(values.items())]


class _HistogramChild:
    __slots__ = ("_lock", "bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self._lock = threading.Lock()
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            self.sum += value
            self.count += 1
            for i, b in enumerate(self.bounds):
                if value <= b:
                    self.counts[i] += 1
                    break

    def snapshot(self) -> tuple[list[int], float, int]:
        with self._lock:
            return list(self.counts), self.sum, self.count


class Histogram(_Metric):
    """Distribution in cumulative buckets (``le``), plus ``_sum`` and ``_count``."""

    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (),
                 buckets: Iterable[float] = DEFAULT_BUCKETS):
        super().__init__(name, help, labelnames)
        if "le" in self.labelnames:
            raise ValueError("'le' is reserved for histogram buckets")
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)

    def _new_child(self):
        return _HistogramChild(self.bounds)

    def observe(self, value: float) -> None:
        self._unlabelled().observe(value)

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._children.items())
        lines = []
        for key, child in items:
            counts, total, count = child.snapshot()
            cumulative = 0
            for bound, n in zip(self.bounds, counts):
                cumulative += n
                le = _label_str(self.labelnames, key, ("le", _format_value(bound) if bound != math.inf else "+Inf"))
                lines.append(f"{self.name}_bucket{le} {cumulative}")
            labels = _label_str(self.labelnames, key)
            lines.append(f"{self.name}_sum{labels} {_format_value(total)}")
            lines.append(f"{self.name}_count{labels} {count}")
        return lines


class Registry:
    """The metrics of one process, in registration order. Names are unique."""

    def __init__(self):
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _Metric) -> _Metric:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self.register(Counter(name, help, labelnames))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = (),
              callback: Optional[Callable[[], CallbackResult]] = None) -> Gauge:
        return self.register(Gauge(name, help, labelnames, callback))

    def histogram(self, name: str, help: str, labelnames: Sequence[str] = (),
                  buckets: Iterable[float] = DEFAULT_BUCKETS) -> Histogram:
        return self.register(Histogram(name, help, labelnames, buckets))

    def get(self, name: str) -> Optional[_Metric]:
        with self._lock:
            return self._metrics.get(name)

    def exposition(self) -> str:
        """The whole registry in the Prometheus text format 0.0.4."""
        with self._lock:
            metrics = list(self._metrics.values())
        return "".join(m.exposition() for m in metrics)


def parse_exposition(text: str) -> dict[tuple[str, frozenset], float]:
    """Parse text-format samples into ``{(name, frozenset(label pairs)): value}`` (for tests and
    for the router reading its workers; comments are skipped, escapes in label values undone)."""
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        labels: list[tuple[str, str]] = []
        if "{" in line:
            name, rest = line.split("{", 1)
            i = 0
            while rest[i] != "}":
                eq = rest.index("=", i)
                key = rest[i:eq].strip(", ")
                j = eq + 2  # past ="
                val = []
                while rest[j] != '"':
                    if rest[j] == "\\":
                        j += 1
                        val.append({"n": "\n"}.get(rest[j], rest[j]))
                    else:
                        val.append(rest[j])
                    j += 1
                labels.append((key, "".join(val)))
                i = j + 1
                while rest[i] in ", ":
                    i += 1
            value = rest[i + 1:].split()[0]
        else:
            name, value = line.split()[:2]
        out[(name.strip(), frozenset(labels))] = float(value)
    return out
