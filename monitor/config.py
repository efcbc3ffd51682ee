"""The service's configuration, read once from an injected environment mapping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from monitor.actions import ActionConfig
from monitor.canaries import CanaryServiceConfig
from monitor.decisions import DecisionConfig
from monitor.engine import EngineConfig
from monitor.metrics.config import MetricsConfig
from policies.devices import DevicesConfig


class ConfigError(ValueError):
    pass


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from exc


@dataclass(frozen=True)
class IngestConfig:
    """Limits of one ingest batch.

    32 MiB and 50,000 records: a 16,384-rank run's step records for one step fit in one
    batch (about 600 bytes each), while one client cannot make the service buffer gigabytes.
    """

    max_batch_bytes: int = 32 * 1024 * 1024
    max_batch_records: int = 50_000

    def __post_init__(self) -> None:
        if self.max_batch_bytes < 1024 or self.max_batch_records < 1:
            raise ConfigError("IngestConfig: max_batch_bytes >= 1024 and max_batch_records >= 1")


@dataclass(frozen=True)
class ServiceConfig:
    db: str | None = None
    admin_token: str | None = None
    ingest: IngestConfig = field(default_factory=IngestConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    decisions: DecisionConfig = field(default_factory=DecisionConfig)
    canaries: CanaryServiceConfig = field(default_factory=CanaryServiceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], db: str | None = None) -> ServiceConfig:
        return cls(
            db=db or environ.get("RUNHEALTH_DB") or None,
            admin_token=environ.get("RUNHEALTH_ADMIN_TOKEN") or None,
            decisions=DecisionConfig(actions=ActionConfig.from_environ(environ)),
            metrics=MetricsConfig.from_environ(environ),
            ingest=IngestConfig(
                max_batch_bytes=_int(environ, "RUNHEALTH_MAX_BATCH_BYTES", IngestConfig.max_batch_bytes),
                max_batch_records=_int(
                    environ, "RUNHEALTH_MAX_BATCH_RECORDS", IngestConfig.max_batch_records
                ),
            ),
        )
