"""One window's per-rank values as arrays, and comparisons of each rank with its peers.

Peers are the ranks of one data-parallel group: the replicas that hold the same model shard
(the same tensor-, pipeline- and context-parallel coordinates) and see different data. A
comparison needs at least three peers: with two, the one that is off cannot be told from
the one that is right.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from policies.stats import finite_median

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

PHASES = ("data_wait", "forward", "backward", "optimizer")
WALL_PHASES = ("forward_wall", "backward_wall", "optimizer_wall")
"""The wall times of the timed phases, sent where ``PHASES`` are thread CPU time (a CPU rank
among several): data wait is wall time already."""


@dataclass(frozen=True)
class RankWindow:
    """Every reporting rank's values for one window; arrays are parallel, NaN = not logged.

    Arrays are never mutated after construction: treat this as the frozen value it is.
    """

    step: int
    attempt: int | None
    incarnation: str
    ranks: Ints
    groups: Ints
    loss_sum: Floats
    tokens: Floats
    phases: dict[str, Floats]
    nodes: tuple[str | None, ...]
    devices: tuple[str | None, ...]
    sample_ids: tuple[Sequence[Any] | None, ...]
    loss_unlogged: Ints | None = None
    """Indices of the ranks that logged no loss at all (a window closed by a crash before its
    first ``rh.loss``): their NaN ``loss_sum`` is "not logged", not a nonfinite loss. ``None``:
    every NaN is a logged one."""

    def peer_groups(self, min_size: int = 3) -> Iterator[npt.NDArray[np.intp]]:
        """Index arrays of each data-parallel group large enough to compare within."""
        if not self.groups.any():  # one group, every rank (no model parallelism): no search
            if len(self.groups) >= min_size:
                yield np.arange(len(self.groups))
            return
        for group in np.unique(self.groups):
            members = np.flatnonzero(self.groups == group)
            if len(members) >= min_size:
                yield members


def peer_median(values: Floats, members: npt.NDArray[np.intp]) -> float:
    """The median over a group's finite values (NaN when none is finite)."""
    return finite_median(values[members])
