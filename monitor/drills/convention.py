"""The drill convention: how ``runhealth drill`` runs the user's own trainer.

The trainer is a command template, the same convention as ``runhealth replay``'s entry point.
Each run fills these fields; a field the template names (``{steps}``) is put there, any other
is appended as a flag (``--steps 10``), so ``python train.py`` and ``python train.py
--steps {steps} --out {checkpoint_dir}`` both work:

- ``steps``: train until this many optimizer updates in all (a resumed run counts on from its
  checkpoint's step), then save a checkpoint at that update and exit 0;
- ``checkpoint_dir``: where checkpoints go; ``resume_from``: a checkpoint to resume from (a
  ``step-N`` directory, or a checkpoint dir: its published one); only when resuming;
- ``save_every``: also save every N updates (preemption drill);
- ``save_stall_seconds``: wait this long after writing a checkpoint's files, before publishing
  it (a slow storage write, so the drill can interrupt a save);
- ``nonfinite_step``, ``straggler_rank``, ``straggler_seconds``: the diagnostics drill's faults:
  rank 0's loss is NaN at that update (first run only); that rank waits that long per window.

Several ranks: the drill starts the command once per rank with torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), as ``torchrun --standalone``
would. A command starting with ``python`` runs in runhealth's own interpreter. SIGTERM: save at the next completed update and exit (the handler only sets a flag).

A checkpoint is a directory ``<checkpoint_dir>/step-<N>`` holding a PyTorch Distributed
Checkpoint of ``{"model": ..., "optimizer": ...}`` (``torch.distributed.checkpoint.state_dict.
get_state_dict``: parameters by name, Adam's ``exp_avg``/``exp_avg_sq``/``step`` per parameter),
``trainer-state.json`` (``step``, ``consumed`` examples, ``examples_per_update``, ``lr`` per
parameter group, ``resumed_from``: the step the run restored, or null, and optionally
``window_seconds`` and ``save_seconds``: the run's window times and its previous save's) and
one ``data-rank<R>.json`` per rank (``next_sample_ids``: what that rank reads next). It is
published by replacing ``<checkpoint_dir>/latest`` (its name) atomically once complete; keep the
last two. ``monitor/demo/drill_trainer.py`` is a trainer that follows all of it.
"""

from __future__ import annotations

import shlex
import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FIELDS = (
    "steps",
    "checkpoint_dir",
    "resume_from",
    "save_every",
    "save_stall_seconds",
    "nonfinite_step",
    "straggler_rank",
    "straggler_seconds",
)


class DrillError(Exception):
    """A drill that cannot run as asked (a bad template, torch missing): one line for the user."""


@dataclass(frozen=True)
class TrainerCommand:
    """The user's command template, filled per run."""

    template: str

    def __post_init__(self) -> None:
        named = {name for _, name, _, _ in string.Formatter().parse(self.template) if name}
        unknown = sorted(named - set(FIELDS))
        if unknown:
            raise DrillError(
                f"the trainer command names unknown fields {unknown} (known: {', '.join(FIELDS)})"
            )
        if not shlex.split(self.template):
            raise DrillError("the trainer command is empty")

    def argv(self, fields: Mapping[str, Any]) -> list[str]:
        given = {name: value for name, value in fields.items() if value is not None}
        named = {name for _, name, _, _ in string.Formatter().parse(self.template) if name}
        filled = self.template.format(**{name: shlex.quote(str(given.get(name, ""))) for name in named})
        argv = shlex.split(filled)
        for name, value in given.items():
            if name not in named:
                argv += [f"--{name.replace('_', '-')}", str(value)]
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # runhealth's own interpreter: a PATH python may lack torch
        return argv
