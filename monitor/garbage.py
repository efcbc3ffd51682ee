"""CPython's cyclic garbage collector in a ``runhealth serve`` process.

A batch of 1,000 step records makes thousands of container objects (validating it alone sets
off four or five young collections at CPython's default thresholds of 700, 10, 10; then the
stored rows, the judge's rows and readings), nearly all freed by reference counting. Every
hundred young collections CPython also walks the older generations, which in a serving
process hold the engine's per-run state, SQLAlchemy's and pydantic's structures and every
imported module. So the collector runs less often here, not never: what cycles there are
(exceptions with their tracebacks, reference loops in libraries) are still collected.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from monitor.errors import ConfigError


@dataclass(frozen=True)
class GarbageConfig:
    """The serving process's collector thresholds (``gc.set_threshold``).

    - ``gen0_threshold`` 10,000 (CPython's default is 700): measured with
      ``benchmarks/ingest.py``'s load (posts of 1,000 step records on PostgreSQL), old and new
      settings alternating three times in one sitting at load 1.0-1.3: service CPU per step
      record 116-135 us with CPython's thresholds, 96-111 us with these, 87-99 us with the
      collector off. A young generation of 10,000 objects is a few megabytes at most.
    - ``gen1_threshold`` and ``gen2_threshold`` 10: CPython's own (older passes per younger).
    - ``enabled`` false leaves the interpreter's thresholds as they are.
    """

    enabled: bool = True
    gen0_threshold: int = 10_000
    gen1_threshold: int = 10
    gen2_threshold: int = 10

    def __post_init__(self) -> None:
        thresholds = (self.gen0_threshold, self.gen1_threshold, self.gen2_threshold)
        if any(threshold < 1 for threshold in thresholds):
            raise ConfigError(f"garbage: every threshold must be >= 1, got {thresholds}")


def apply(config: GarbageConfig) -> tuple[int, int, int]:
    """Set the collector's thresholds from ``config``; the thresholds before, to restore."""
    before = gc.get_threshold()
    if config.enabled:
        gc.set_threshold(config.gen0_threshold, config.gen1_threshold, config.gen2_threshold)
    return before
