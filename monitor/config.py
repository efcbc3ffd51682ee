"""The service's configuration, read once from an injected environment mapping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from monitor.judge.canaries import CanaryServiceConfig
from monitor.judge.engine import EngineConfig
from monitor.observe.metrics.config import MetricsConfig
from monitor.recovery.decisions import DecisionConfig
from monitor.recovery.quarantine import ActionConfig
from policies.devices import DevicesConfig
from policies.hangs import HangConfig


class ConfigError(ValueError):
    pass


def _number(environ: Mapping[str, str], name: str, default: float, kind: type[int] | type[float]) -> Any:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError as exc:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{name} must be {what}, got {raw!r}") from exc


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    return int(_number(environ, name, default, int))


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    return float(_number(environ, name, default, float))


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
            engine=EngineConfig(
                hangs=HangConfig(
                    min_timeout_s=_float(environ, "RUNHEALTH_HANG_MIN_TIMEOUT_S", HangConfig.min_timeout_s),
                    heartbeat_interval_s=_float(
                        environ, "RUNHEALTH_HEARTBEAT_S", HangConfig.heartbeat_interval_s
                    ),
                )
            ),
            ingest=IngestConfig(
                max_batch_bytes=_int(environ, "RUNHEALTH_MAX_BATCH_BYTES", IngestConfig.max_batch_bytes),
                max_batch_records=_int(
                    environ, "RUNHEALTH_MAX_BATCH_RECORDS", IngestConfig.max_batch_records
                ),
            ),
        )
