"""What a run's hook says about itself in its run_start record (``config["runhealth_hook"]``):
its directive poll interval, agreement period, heartbeat and flush intervals. The service
times its judgements by them instead of assuming the defaults."""

from __future__ import annotations

from typing import Any


def stated(run_config: Any, key: str) -> float | None:
    """A positive number the hook stated under ``key``, else ``None`` (absent, or not usable)."""
    hook = run_config.get("runhealth_hook") if isinstance(run_config, dict) else None
    value = hook.get(key) if isinstance(hook, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return None
    return float(value)
