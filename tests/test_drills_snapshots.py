"""Reading drill checkpoints: without torch the drill says so, and an incomplete checkpoint
is named with what it lacks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from monitor.drills import snapshots
from monitor.drills.convention import DrillError

WITHOUT_TORCH = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` now raises ImportError, as if not installed
    from pathlib import Path
    from monitor.drills import snapshots
    from monitor.drills.convention import DrillError
    try:
        snapshots.load(Path(sys.argv[1]))
    except DrillError as exc:
        print(exc)
    """
)


def test_without_torch_the_drill_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "reads the trainer's checkpoints with torch, which is not installed here" in done.stdout


def test_an_incomplete_checkpoint_names_what_it_lacks(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step-4"
    checkpoint.mkdir()
    (checkpoint / "trainer-state.json").write_text(
        json.dumps({"step": 4, "consumed": 96, "lr": [0.1], "world_size": 2})
    )
    (checkpoint / "data-rank0.json").write_text(json.dumps({"rank": 0, "next_sample_ids": [1]}))
    assert snapshots.incomplete(checkpoint) == [".metadata", "data-rank1.json"]
    with pytest.raises(DrillError, match=r"step-4 is incomplete: no \.metadata, data-rank1\.json"):
        snapshots.load(checkpoint)


def test_published_follows_the_pointer(tmp_path: Path) -> None:
    assert snapshots.published(tmp_path) is None
    (tmp_path / "latest").write_text("step-8\n")
    assert snapshots.published(tmp_path) == tmp_path / "step-8"
