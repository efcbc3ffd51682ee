"""``/metrics``: Prometheus collectors over the store and the service, on an injected registry.

- ``names``: every series, its type, labels and help (dashboards and rules are built from it).
- ``config``: ``MetricsConfig`` (bounds on a scrape); ``sources``: ``MetricSources`` (data
  other components own: pending proposals, canary verdicts).
- ``reads``: the store queries; ``state``: the service's in-memory readings;
  ``families``: snapshot -> metric families; ``exporter``: the collector and its registry.
"""

from monitor.observe.metrics.config import MetricsConfig
from monitor.observe.metrics.exporter import RunHealthCollector, metrics_registry
from monitor.observe.metrics.sources import CanaryVerdict, MetricSources

__all__ = ["CanaryVerdict", "MetricSources", "MetricsConfig", "RunHealthCollector", "metrics_registry"]
