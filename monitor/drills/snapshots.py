"""Reading a drill checkpoint (the convention's ``step-<N>`` directory) into plain arrays.

Torch is imported here only, when a drill reads a checkpoint: the rest of the service runs
without it. The DCP shards are gathered into one state dict (``dcp_to_torch_save``), so a
checkpoint saved on 2 ranks and one saved on 4 are compared name by name.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from monitor.drills.convention import DrillError

POINTER = "latest"
STATE = "trainer-state.json"


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint's contents: ``model`` and ``optimizer`` arrays by name, its trainer state,
    and each rank's next sample ids."""

    path: Path
    model: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    state: dict[str, Any]
    next_ids: dict[int, list[int]]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def require_torch() -> Any:
    try:
        import torch
        import torch.distributed.checkpoint.format_utils
    except ImportError as exc:
        raise DrillError(
            "this drill reads the trainer's checkpoints with torch, which is not installed here: "
            "run it where the trainer's environment is (pip install torch)"
        ) from exc
    return torch


def published(checkpoint_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when none was published."""
    pointer = checkpoint_dir / POINTER
    if not pointer.exists():
        return None
    return checkpoint_dir / pointer.read_text().strip()


def step_dir(checkpoint_dir: Path, step: int) -> Path:
    return checkpoint_dir / f"step-{step}"


def incomplete(path: Path) -> list[str]:
    """What a checkpoint lacks to be complete (empty when complete)."""
    if not path.is_dir():
        return [f"{path} is not a directory"]
    lacking = [name for name in (".metadata", STATE) if not (path / name).exists()]
    if (path / STATE).exists():
        world = int(json.loads((path / STATE).read_text()).get("world_size", 1))
        lacking += [f"data-rank{r}.json" for r in range(world) if not (path / f"data-rank{r}.json").exists()]
    return lacking


def trainer_state(path: Path) -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as exc:
        raise DrillError(f"{path / STATE} is not readable: {exc}") from exc
    for key in ("step", "consumed", "lr"):
        if key not in state:
            raise DrillError(
                f"{path / STATE} has no {key!r} (the drill convention: monitor/drills/convention.py)"
            )
    return state


def next_ids(path: Path) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for file in sorted(path.glob("data-rank*.json")):
        document = json.loads(file.read_text())
        ids[int(document["rank"])] = [int(i) for i in document["next_sample_ids"]]
    return ids


def load(path: Path) -> Snapshot:
    """The checkpoint's tensors as float64 arrays (``model.<name>``, ``optimizer.<name>.<key>``)."""
    torch = require_torch()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    lacking = incomplete(path)
    if lacking:
        raise DrillError(f"checkpoint {path} is incomplete: no {', '.join(lacking)}")
    with tempfile.TemporaryDirectory(prefix="runhealth-drill-") as scratch:
        whole = Path(scratch, "whole.pt")
        dcp_to_torch_save(str(path), str(whole))
        loaded = torch.load(whole, weights_only=False)
    return Snapshot(
        path=path,
        model=_arrays(loaded.get("model", {})),
        optimizer=_arrays(loaded.get("optimizer", {}).get("state", {})),
        state=trainer_state(path),
        next_ids=next_ids(path),
    )


def _arrays(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """Every tensor or number in a nested state dict, by its dotted path."""
    arrays: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            arrays.update(_arrays(value, f"{name}."))
        elif hasattr(value, "detach"):
            arrays[name] = value.detach().to("cpu").double().numpy()
        elif isinstance(value, int | float):
            arrays[name] = np.asarray(float(value))
    return arrays


def updates(before: Snapshot, after: Snapshot) -> dict[str, np.ndarray]:
    """The gradient update between two consecutive checkpoints: each weight's change."""
    return {name: after.model[name] - before.model[name] for name in before.model if name in after.model}
