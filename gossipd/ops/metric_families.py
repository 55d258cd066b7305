"""Building Prometheus metric families from plain values: the short forms every collector
of gossipd uses (one unlabelled sample, one sample per label value)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def _one(family: type[Any], name: str, doc: str, value: float) -> Metric:
    """A family with one unlabelled sample."""
    metric = family(name, doc)
    metric.add_metric([], value)
    return metric


def _by(
    family: type[Any], name: str, doc: str, label: str, values: Iterable[tuple[str, float]]
) -> Metric:
    """A family with one sample per value of ``label``."""
    metric = family(name, doc, labels=[label])
    for key, value in values:
        metric.add_metric([key], value)
    return metric


C, G = CounterMetricFamily, GaugeMetricFamily
