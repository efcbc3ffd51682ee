"""What ``/metrics`` exports, and how much of it."""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_GRAINS = ("auto", "device", "node", "off")
LINK_GRAINS = ("auto", "port", "node", "off")


@dataclass(frozen=True)
class MetricsConfig:
    """Bounds on what one scrape costs.

    - ``top_stragglers`` 8: per-rank series only for the slowest ranks, so a 16,384-rank run costs
      8 straggler series, not 16,384; an operator looks at the few slowest ranks, and the engine's
      straggler incidents name every flagged one.
    - ``open_incidents_per_run`` 20: per-incident series (for alerts that name the incident and
      Grafana annotations) for a run's newest open incidents; ``runhealth_incidents_open`` still
      counts all of them.
    - ``recent_windows`` 32: tokens per second is measured over the newest 32 judged windows of
      the current incarnation, long enough to smooth one slow step (a checkpoint save), short
      enough to show a slowdown within a minute at a few seconds per step.
    - ``run_retention_s`` 86,400: a run with no record for a day is no longer exported, so a
      finished run's series end and Prometheus marks them stale (the hang watch gives up on an
      incarnation after the same day).
    - ``device_series`` "auto" (or "device", "node", "off") and ``link_series`` "auto" (or
      "port", "node", "off"): device and port counters one series per device (port), or summed
      per node. "auto" is per device (port) while the run has at most ``per_device_limit`` of
      them, per node beyond: measured with 16,384 devices and ports, per-device series are
      295,000 series and a 3-4 s scrape, per-node ones 37,000 and 0.8-1.1 s, none 0.2-0.3 s (see
      the README's Metrics section). "off" where dcgm-exporter and an InfiniBand exporter already
      export the same counters.
    - ``per_device_limit`` 1,024: at most 18,000 device and port series, about 0.2 s of exposition.
    """

    top_stragglers: int = 8
    open_incidents_per_run: int = 20
    recent_windows: int = 32
    run_retention_s: float = 86_400.0
    device_series: str = "auto"
    link_series: str = "auto"
    per_device_limit: int = 1024

    def __post_init__(self) -> None:
        if self.top_stragglers < 0 or self.open_incidents_per_run < 0 or self.per_device_limit < 0:
            raise ValueError("MetricsConfig: top_stragglers, open_incidents_per_run, per_device_limit >= 0")
        if self.recent_windows < 2 or not self.run_retention_s > 0:
            raise ValueError("MetricsConfig: recent_windows >= 2, run_retention_s > 0")
        if self.device_series not in DEVICE_GRAINS or self.link_series not in LINK_GRAINS:
            raise ValueError(f"MetricsConfig: device_series in {DEVICE_GRAINS}, link_series in {LINK_GRAINS}")

    def device_grain(self, devices: int) -> str:
        """ "device", "node" or "off" for a run with this many devices."""
        if self.device_series != "auto":
            return self.device_series
        return "device" if devices <= self.per_device_limit else "node"

    def link_grain(self, ports: int) -> str:
        """ "port", "node" or "off" for a run with this many ports."""
        if self.link_series != "auto":
            return self.link_series
        return "port" if ports <= self.per_device_limit else "node"
