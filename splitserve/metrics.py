"""Prometheus metrics on ``prometheus-client``: one registry per process, and derived metrics.

There is no global registry: each process (worker app, router) creates one :class:`Registry` and
hands it to whoever records metrics, so two apps in one test process never share counters.
What a process records itself (a request's end, its latencies) are ordinary counters and
histograms (``reg.counter(name, help, labelnames)``, ``reg.histogram(..., buckets=...)``). A
histogram fed a whole request's observations at once (the gaps between its streamed tokens) is a
:class:`BatchHistogram` (``reg.batch_histogram``): one lock and one binary search a value.

What another structure owns (the engine's pages and queues, the lifecycle table, the peers, the
threads' counters) is **derived** (``docs/metrics.md``): a collector reads it at scrape time::

    reg.derived_gauge("splitserve_kv_pages_free", "Free KV pages.", read=lambda: engine.stats().pages_free)

``read`` returns a number, or ``{label values: value}`` (a tuple in ``labelnames`` order, or a
plain string for one label), or ``None`` (no samples now). A ``read`` that raises makes that one
metric show no samples for this scrape (and is logged), it never breaks ``/metrics``. Counters are
exposed without their ``_created`` samples (``disable_created_metrics``). :func:`parse_exposition`
reads a scrape back with ``prometheus-client``'s own parser (tests, and ``splitserve top``).
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

prometheus_client.disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

ReadResult = Union[None, float, int, Mapping]


class DerivedMetric:
    """A collector of one metric whose samples ``read()`` gives at scrape time."""

    def __init__(self, kind: str, name: str, help: str, labelnames: Sequence[str], read: Callable[[], ReadResult]):
        self.kind, self.name, self.help = kind, name, help
        self.labelnames = list(labelnames)
        self.read = read

    def _family(self):
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=self.labelnames)
        return GaugeMetricFamily(self.name, self.help, labels=self.labelnames)

    def describe(self) -> Iterable:
        return [self._family()]

    def collect(self) -> Iterable:
        family = self._family()
        try:
            for labels, value in self._values():
                family.add_metric(labels, value)
        except Exception as exc:  # a broken reader hides its metric, never the whole page
            log.warning("metric %s: reading it failed: %r", self.name, exc)
            return [self._family()]
        return [family]

    def _values(self) -> list[tuple[list[str], float]]:
        result = self.read()
        if result is None:
            return []
        if not isinstance(result, Mapping):
            if self.labelnames:
                raise ValueError(f"{self.name} has labels; its reader must return a mapping")
            return [([], float(result))]
        out = []
        for key, value in result.items():
            key = (key,) if isinstance(key, str) else tuple(key)
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: reader gave labels {key} for {self.labelnames}")
            if value is not None:
                out.append(([str(k) for k in key], float(value)))
        return out


class BatchHistogram:
    """A histogram whose observations come in batches: ``observe_many(values, *label values)``.
    Exposed as an ordinary Prometheus histogram (``_bucket``, ``_sum``, ``_count``); a label set
    shows up with its first batch."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str], buckets: Iterable[float]):
        self.name, self.help, self.labelnames = name, help, list(labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        self._series: dict[tuple[str, ...], list] = {}  # label values -> [counts a bucket (+Inf last), sum]
        self._lock = threading.Lock()  # a scrape may run on another thread than the observer

    def observe_many(self, values: Iterable[float], *labelvalues: str) -> None:
        if len(labelvalues) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labelvalues}")
        counts, total, bounds = [0] * (len(self.bounds) + 1), 0.0, self.bounds
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1  # a bucket holds values <= its bound
            total += v
        key = tuple(str(v) for v in labelvalues)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = [[0] * len(counts), 0.0]
            series[0] = [a + b for a, b in zip(series[0], counts)]
            series[1] += total

    def describe(self) -> Iterable:
        return [HistogramMetricFamily(self.name, self.help, labels=self.labelnames)]

    def collect(self) -> Iterable:
        family = HistogramMetricFamily(self.name, self.help, labels=self.labelnames)
        with self._lock:
            series = [(key, list(counts), total) for key, (counts, total) in self._series.items()]
        for key, counts, total in series:
            cumulative, buckets = 0, []
            for bound, n in zip(self.bounds + (float("inf"),), counts):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else floatToGoString(bound), cumulative))
            family.add_metric(list(key), buckets, total)
        return [family]


class Registry:
    """The metrics of one process. Names are unique (``prometheus_client`` refuses a duplicate)."""

    def __init__(self):
        self.collectors = CollectorRegistry()

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> prometheus_client.Counter:
        return prometheus_client.Counter(name, help, list(labelnames), registry=self.collectors)

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> prometheus_client.Gauge:
        return prometheus_client.Gauge(name, help, list(labelnames), registry=self.collectors)

    def histogram(self, name: str, help: str, labelnames: Sequence[str] = (),
                  buckets: Iterable[float] = DEFAULT_BUCKETS) -> prometheus_client.Histogram:
        return prometheus_client.Histogram(name, help, list(labelnames), registry=self.collectors,
                                           buckets=tuple(buckets))

    def batch_histogram(self, name: str, help: str, labelnames: Sequence[str] = (),
                        buckets: Iterable[float] = DEFAULT_BUCKETS) -> BatchHistogram:
        return self._register(BatchHistogram(name, help, labelnames, buckets))

    def derived_gauge(self, name: str, help: str, labelnames: Sequence[str] = (), *,
                      read: Callable[[], ReadResult]) -> DerivedMetric:
        return self._register(DerivedMetric("gauge", name, help, labelnames, read))

    def derived_counter(self, name: str, help: str, labelnames: Sequence[str] = (), *,
                        read: Callable[[], ReadResult]) -> DerivedMetric:
        """A count kept by another structure (it only goes up); ``name`` ends in ``_total``."""
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        return self._register(DerivedMetric("counter", name.removesuffix("_total"), help, labelnames, read))

    def _register(self, metric):
        self.collectors.register(metric)
        return metric

    def exposition(self) -> str:
        """The whole registry in the Prometheus text format 0.0.4."""
        return generate_latest(self.collectors).decode("utf-8")


def parse_exposition(text: str) -> dict[tuple[str, frozenset], float]:
    """A scrape as ``{(sample name, frozenset(label pairs)): value}``, read by ``prometheus-client``'s
    parser (a counter's samples keep their ``_total``, a histogram's their ``_bucket``/``_sum``/``_count``)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_families(text: str) -> dict[str, str]:
    """``{family name: type}`` of a scrape (counters without their ``_total``)."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}
