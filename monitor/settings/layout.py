"""Where each setting lives: its name in the environment and the file, and its place in
``ServiceConfig``.

The settings are the fields of the frozen config dataclasses themselves, found by walking a
default ``ServiceConfig``: a field added to a policy's config is a setting with no edit here.
The tree is regrouped only at its top, so an operator finds every detection threshold under
``policies`` (``policies.spike.z``, ``RUNHEALTH_POLICIES__SPIKE__Z``) instead of behind the
engine's wiring (``engine.series.loss_spike.z``).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from monitor.config import ServiceConfig

PREFIX = "RUNHEALTH_"
DELIMITER = "__"

Path = tuple[str, ...]

# Settings section -> its place in ServiceConfig. A nested dataclass not named here is a
# subsection of its parent's section (policies.devices.peers).
SECTIONS: Mapping[Path, Path] = {
    (): (),
    ("ingest",): ("ingest",),
    ("engine",): ("engine",),
    ("metrics",): ("metrics",),
    ("decisions",): ("decisions",),
    ("quarantine",): ("decisions", "actions"),
    ("canaries",): ("canaries",),
    ("scheduler",): ("scheduler",),
    ("retention",): ("retention",),
    ("replicas",): ("replicas",),
    ("garbage",): ("garbage",),
    ("policies", "spike"): ("engine", "series", "loss_spike"),
    ("policies", "grad_norm_spike"): ("engine", "series", "grad_norm_spike"),
    ("policies", "numerics"): ("engine", "series", "numerics"),
    ("policies", "normalization"): ("engine", "series", "normalization"),
    ("policies", "continuity"): ("engine", "series", "continuity"),
    ("policies", "grouping"): ("engine", "series", "grouping"),
    ("policies", "rank_loss"): ("engine", "rank_loss"),
    ("policies", "rank_nonfinite"): ("engine", "rank_nonfinite"),
    ("policies", "stragglers"): ("engine", "stragglers"),
    ("policies", "hangs"): ("engine", "hangs"),
    ("policies", "readiness"): ("engine", "readiness"),
    ("policies", "restart_loop"): ("engine", "restart_loop"),
    ("policies", "batch"): ("engine", "batch"),
    ("policies", "checkpoint_interval"): ("engine", "checkpoint_interval"),
    ("policies", "preemption"): ("engine", "preemption"),
    ("policies", "devices"): ("devices",),
    ("policies", "canary"): ("canaries", "comparison"),
    ("policies", "canary_schedule"): ("canaries", "schedule"),
    ("policies", "retries"): ("decisions", "retries"),
    ("policies", "proposals"): ("decisions", "proposals"),
    ("policies", "response"): ("decisions", "responses"),
}

# The flat names the service read before the settings existed (the README documents them);
# they stay spellings of the same settings.
LEGACY_VARIABLES: Mapping[str, Path] = {
    "RUNHEALTH_HANG_MIN_TIMEOUT_S": ("policies", "hangs", "min_timeout_s"),
    "RUNHEALTH_HEARTBEAT_S": ("policies", "hangs", "heartbeat_interval_s"),
    "RUNHEALTH_MAX_BATCH_BYTES": ("ingest", "max_batch_bytes"),
    "RUNHEALTH_MAX_BATCH_RECORDS": ("ingest", "max_batch_records"),
    "RUNHEALTH_METRICS_TOP_STRAGGLERS": ("metrics", "top_stragglers"),
    "RUNHEALTH_METRICS_DEVICE_SERIES": ("metrics", "device_series"),
    "RUNHEALTH_METRICS_LINK_SERIES": ("metrics", "link_series"),
    "RUNHEALTH_METRICS_PER_DEVICE_LIMIT": ("metrics", "per_device_limit"),
    "RUNHEALTH_QUARANTINE_COMMAND": ("quarantine", "command"),
    "RUNHEALTH_QUARANTINE_WEBHOOK": ("quarantine", "webhook"),
    "RUNHEALTH_QUARANTINE_LIVE": ("quarantine", "live"),
    # The notice a run owner knows for their platform (the README's preemption budget part).
    "RUNHEALTH_PREEMPTION_WARNING_S": ("policies", "preemption", "warning_s"),
}

# The trainer's sections (collectors.config.RunHealthConfig's components: the hook reads
# RUNHEALTH_HOOK__SHIFT_LABELS and the like, and the embedded service inherits its environment);
# the service leaves their variables alone. tests/test_collectors_config.py keeps this in step.
TRAINER_SECTIONS = frozenset(
    {"transport", "hook", "ring", "sender", "spool", "embedded", "directives", "readers", "relay"}
)

# Fields that are tables kept in code, not thresholds: NVIDIA's XID catalog (policies/xid.py).
NOT_SETTINGS: frozenset[Path] = frozenset({("devices", "xid_catalog")})


@dataclass(frozen=True)
class Leaf:
    """One setting: ``name`` in the settings tree, ``target`` in ``ServiceConfig`` (a mapping's
    key is one step of it), ``kind`` its annotation, ``default`` its value in the default config."""

    name: Path
    target: Path
    kind: Any
    default: Any

    @property
    def dotted(self) -> str:
        return ".".join(self.name)

    @property
    def variable(self) -> str:
        return PREFIX + DELIMITER.join(self.name).upper()


def leaves(defaults: ServiceConfig | None = None) -> list[Leaf]:
    """Every setting, in the order ``runhealth config show`` lists them."""
    root = ServiceConfig() if defaults is None else defaults
    found: list[Leaf] = []
    for section, target in SECTIONS.items():
        found.extend(_walk(value_at(root, target), section, target))
    return found


def value_at(root: Any, target: Path) -> Any:
    node = root
    for step in target:
        node = node[step] if isinstance(node, Mapping) else getattr(node, step)
    return node


def _walk(node: Any, name: Path, target: Path) -> Iterator[Leaf]:
    hints = typing.get_type_hints(type(node))
    for item in dataclasses.fields(node):
        here, value = (*target, item.name), getattr(node, item.name)
        if here in NOT_SETTINGS or here in SECTIONS.values():
            continue
        if dataclasses.is_dataclass(value):
            yield from _walk(value, (*name, item.name), here)
        elif _is_table(value):
            for key, entry in value.items():
                yield from _walk(entry, (*name, item.name, key), (*here, key))
        else:
            yield Leaf((*name, item.name), here, hints[item.name], value)


def _is_table(value: Any) -> bool:
    """A mapping of named configs (the per-signal limits): each entry is a subsection."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(key, str) and dataclasses.is_dataclass(entry) for key, entry in value.items())
    )
