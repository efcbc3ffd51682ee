"""What the service already holds in memory that ``/metrics`` reads instead of the store.

The fleet watch keeps each device's and port's newest reading, and the policy engine keeps each
run's smoothed straggler ratios. Reading them costs a dictionary copy; deriving the same from
the store would scan every device sample (16,384 devices every 10 s is 140 million rows a day)
or every step record. Both live in private attributes of classes this package does not own:
this module is the one place that reaches into the fleet watch, under its lock, until it grows a
public accessor (``FleetWatch.latest()`` would replace it); the engine's is ``policy_state``.
"""

from __future__ import annotations

import math

import numpy as np

from monitor.judge.engine import PolicyEngine
from monitor.judge.fleet import FleetWatch
from policies.devices import DeviceReading, LinkReading
from policies.stragglers import StragglerPolicy, StragglerScore, StragglerState


def device_readings(fleet: FleetWatch) -> list[tuple[int, DeviceReading]]:
    """(run id, newest reading) of every device the fleet watch has seen since it started."""
    with fleet._lock:
        return [(key[0], reading) for key, reading in fleet._devices.items()]


def link_readings(fleet: FleetWatch) -> list[tuple[int, LinkReading]]:
    """(run id, newest reading) of every port the fleet watch has seen since it started."""
    with fleet._lock:
        return [(key[0], reading) for key, reading in fleet._links.items()]


def straggler_state(policies: PolicyEngine, run_id: int) -> StragglerState | None:
    """The run's straggler state as the engine last updated it, or None before its first window
    (after a service restart the engine warms up anew, and so do these series)."""
    state = policies.policy_state(run_id, StragglerPolicy.name)
    return state if isinstance(state, StragglerState) else None


def top_stragglers(state: StragglerState, min_windows: int, k: int) -> list[StragglerScore]:
    """The ``k`` highest of ``policies.stragglers.straggler_scores`` (each judged rank's worst
    phase as a ratio to its peers' median), vectorised: the policy's loop over ranks costs
    ~80 ms per scrape at 16,384 ranks, this a few."""
    size = len(state.observed)
    if k == 0 or size == 0 or not state.smoothed:
        return []
    phases = list(state.smoothed)
    stacked = np.zeros((len(phases), size))
    for index, phase in enumerate(phases):
        values = state.smoothed[phase][:size]
        stacked[index, : len(values)] = values
    judged = np.flatnonzero(state.observed >= min_windows)
    if len(judged) == 0:
        return []
    worst_phase = np.argmax(stacked[:, judged], axis=0)  # the first maximum, as max() picks it
    worst = stacked[worst_phase, judged]
    chosen = np.argsort(-worst, kind="stable")[:k]
    return [
        StragglerScore(int(state.rank_ids[judged[i]]), phases[int(worst_phase[i])], math.exp(float(worst[i])))
        for i in chosen
    ]
