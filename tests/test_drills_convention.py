"""The drill convention's command template: named fields filled, the others appended as flags."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from monitor.drills.convention import DrillError, TrainerCommand


def test_fields_the_template_does_not_name_are_flags() -> None:
    argv = TrainerCommand("python train.py --lr 1e-3").argv(
        {"steps": 10, "checkpoint_dir": Path("/tmp/c d"), "resume_from": None}
    )
    assert argv == [
        sys.executable,
        "train.py",
        "--lr",
        "1e-3",
        "--steps",
        "10",
        "--checkpoint-dir",
        "/tmp/c d",
    ]


def test_named_fields_are_put_in_place_and_quoted() -> None:
    argv = TrainerCommand("torchrun-free ./train --out={checkpoint_dir} -n {steps}").argv(
        {"steps": 3, "checkpoint_dir": "/tmp/a b", "save_every": 1}
    )
    assert argv == ["torchrun-free", "./train", "--out=/tmp/a b", "-n", "3", "--save-every", "1"]


def test_an_unknown_field_or_an_empty_command_is_refused() -> None:
    with pytest.raises(DrillError, match=r"unknown fields \['step'\]"):
        TrainerCommand("python train.py --steps {step}")
    with pytest.raises(DrillError, match="empty"):
        TrainerCommand("   ")
