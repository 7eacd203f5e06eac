"""Actor metrics: exported through ``ray.util.metrics`` and kept locally for ``stats()``.

Examples:
    >>> m = ActorMetrics("shard", {"shard": "off-0"}, export=False)
    >>> m.count("rows_sampled", 32); m.observe("sample_ms", 1.5)
    >>> s = m.snapshot(); s["rows_sampled"], s["sample_ms_p50"]
    (32, 1.5)
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from rayrb.core.names import name_key

EXPORT_EVERY = 1.0  # seconds between exports of counters to Ray's metrics
_BOUNDARIES_MS = [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 1000]


class ActorMetrics:
    """Counters, gauges and latency windows for one actor, tagged with its identity."""

    def __init__(self, component: str, tags: dict[str, str], *, export: bool = True, window: int = 2048):
        self.component, self.tags = component, dict(tags)
        self._counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._windows: dict[str, deque] = {}
        self._window = window
        self._export = export
        self._ray: dict[str, Any] = {}
        self._started = time.time()
        self._unexported: dict[str, float] = {}  # counter increments not yet handed to Ray
        self._unobserved: dict[str, list[float]] = {}  # latencies not yet handed to Ray
        self._exported_at = 0.0

    def _metric(self, kind: str, name: str):
        if not self._export:
            return None
        key = f"{kind}:{name}"
        if key not in self._ray:
            try:
                from ray.util import metrics

                full = f"rayrb_{self.component}_{name}"
                tag_keys = tuple(self.tags)
                if kind == "counter":
                    m = metrics.Counter(full, description=f"rayrb {self.component} {name}", tag_keys=tag_keys)
                elif kind == "gauge":
                    m = metrics.Gauge(full, description=f"rayrb {self.component} {name}", tag_keys=tag_keys)
                else:
                    m = metrics.Histogram(full, description=f"rayrb {self.component} {name}",
                                          boundaries=_BOUNDARIES_MS, tag_keys=tag_keys)
                m.set_default_tags({k: name_key(v) for k, v in self.tags.items()})  # Ray takes ASCII tags only
            except Exception:  # metrics are best-effort: never fail a data path over them
                m = None
            self._ray[key] = m
        return self._ray[key]

    def count(self, name: str, value: float = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + value
        if self._export and value > 0:
            self._unexported[name] = self._unexported.get(name, 0) + value
            self._flush()

    def _flush(self, every: float = EXPORT_EVERY) -> None:
        """Hand counter increments to Ray at most every ``every`` seconds: each costs microseconds on a hot path."""
        now = time.monotonic()
        if now - self._exported_at < every:
            return
        self._exported_at = now
        pending, self._unexported = self._unexported, {}
        for name, value in pending.items():
            m = self._metric("counter", name)
            if m is not None:
                m.inc(value)
        observed, self._unobserved = self._unobserved, {}
        for name, values in observed.items():
            m = self._metric("histogram", name)
            if m is not None:
                for v in values:
                    m.observe(v)

    def gauge(self, name: str, value: float) -> None:
        self._gauges[name] = value
        m = self._metric("gauge", name)
        if m is not None:
            m.set(value)

    def observe(self, name: str, value_ms: float) -> None:
        self._windows.setdefault(name, deque(maxlen=self._window)).append(value_ms)
        if self._export:
            pending = self._unobserved.setdefault(name, [])
            if len(pending) < self._window:  # past that, a second's worth is a sample enough
                pending.append(value_ms)
            self._flush()

    def snapshot(self) -> dict[str, Any]:
        self._flush(every=0.0)
        out: dict[str, Any] = {**self.tags, **self._counters, **self._gauges}
        elapsed = max(time.time() - self._started, 1e-9)
        for name, value in self._counters.items():
            out[f"{name}_per_s"] = value / elapsed
        for name, window in self._windows.items():
            w = np.asarray(window)
            out[f"{name}_p50"] = float(np.percentile(w, 50))
            out[f"{name}_p99"] = float(np.percentile(w, 99))
        return out
