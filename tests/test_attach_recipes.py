"""The README's attach recipes, run on the test trainers of ``tests/trainers/`` against a real
``runhealth serve``.

- The attach line counts (``scripts/attach_lines.py``): added lines against the same trainer
  without the hook, within issue 14's targets.
- The nanoGPT-style loop under ``torchrun``, 4 gloo ranks on the CPU, with the hook and values
  alone: a clean run, every window of every rank stored, 0 incidents, no dead letters. (With
  checkpoints, resume and rollback: ``tests/test_attach_nanogpt.py``.)
- A transformers ``Trainer`` subclass and a Lightning module with manual optimization, each
  attached by the README's callback line: short real runs whose windows are stored.

The helpers live in ``tests/attach_support.py``; the names other test files import from here
are re-exported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.attach_support import (
    TARGETS,
    TRAINERS,
    WORLD,
    Job,
    cli,
    every_rank_resumed_to,
    job,
    serve,
    token_files,
    workdir,
)
from tests.collectors_support import REPO, ServeProcess, child_environ
from tests.support import require_module

require_module("torch")
pytestmark = pytest.mark.slow
# The fixtures, used by name; the rest for the test files that import them from here.
__all__ = [
    "TARGETS",
    "TRAINERS",
    "Job",
    "cli",
    "every_rank_resumed_to",
    "job",
    "serve",
    "token_files",
    "workdir",
]


def test_the_attach_line_counts_are_within_the_targets() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "attach_lines.py"), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    counts = {c["hooked"]: c for c in json.loads(result.stdout)}
    assert counts["nanogpt_values.py"]["added"] <= 5
    assert counts["nanogpt_hooked.py"]["added"] <= 10
    assert counts["hf_hooked.py"]["added"] <= 2 and counts["lightning_hooked.py"]["added"] <= 2
    assert all(not c["unexplained"] for c in counts.values()), counts
    assert result.returncode == 0, result.stdout


def test_the_line_counter_counts_code_not_comments_or_blank_lines(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import attach_lines
    finally:
        sys.path.remove(str(REPO / "scripts"))
    plain = '"""doc"""\nf(1)\ny = 2\n'
    hooked = '"""other doc"""\nimport rh  # the hook\n\n# a comment\nrh.wrap(f(1))\ny = 2\nz = 3\n'
    (tmp_path / "plain.py").write_text(plain)
    (tmp_path / "hooked.py").write_text(hooked)
    counted = attach_lines.count(attach_lines.Pair("t", "plain.py", "hooked.py", 3), tmp_path)
    assert (counted.added, counted.removed, counted.unexplained) == (3, 1, [])
    assert counted.within_target
    (tmp_path / "hooked.py").write_text(hooked.replace("y = 2", "y = 3"))
    drifted = attach_lines.count(attach_lines.Pair("t", "plain.py", "hooked.py", 9), tmp_path)
    assert drifted.unexplained == ["y = 2"] and not drifted.within_target


def test_nanogpt_with_the_hook_and_values_alone_stores_every_window_and_opens_no_incident(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    clean = job(workdir, serve, "nanogpt-clean", request, **TARGETS)
    clean.torchrun("nanogpt_values.py", "--max_iters=120")
    clean.wait()
    windows = 121  # iterations 0..120
    steps = clean.rows("step_records")
    assert len(steps) == WORLD * windows, len(steps)  # the last window, closed at exit, too
    assert {s["rank"] for s in steps} == set(range(WORLD))
    last = max(steps, key=lambda s: s["attempt"])
    assert last["step"] == windows
    # Examples from the label rows: 4 rows x 2 microbatches x 4 ranks per update.
    assert last["consumed"] == windows * 4 * 2 * WORLD
    assert all(s["tokens"] == 4 * 32 * 2 for s in steps)
    assert all(s["grad_norm"] is not None and s["loss_sum"] is not None for s in steps)
    clean.judged()
    # Four ranks on two cores beside another test worker: a rank that shares its core for a
    # while is really slower in wall time (CI named rank 2 48% slower once), a straggler warning
    # about the host, not the run; the straggler rule's tests plant slow ranks of their own.
    assert [i for i in clean.rows("incidents") if i["kind"] != "straggler"] == []
    assert clean.dead_letters() == []


def test_a_trainer_subclass_attached_by_the_callback_line_stores_its_windows(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    require_module("transformers")
    hf = job(workdir, serve, "hf-subclass", request)
    hf.python("hf_hooked.py", "--max_steps=12", "--output_dir=out-hf")
    hf.wait()
    steps = hf.rows("step_records")
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert all(s["loss_sum"] is not None and s["grad_norm"] is not None for s in steps)
    checkpoints = hf.rows("checkpoint_events")
    assert {c["step"] for c in checkpoints} >= {6, 12}
    assert hf.dead_letters() == []


def test_a_trainer_subclass_on_four_ranks_resumed_without_its_data_skip_is_a_cursor_reset(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    """The Trainer subclass under ``torchrun`` (4 gloo ranks): 12 clean steps, then a resume
    from checkpoint-6 with ``ignore_data_skip``, which restores weights, optimizer and schedule
    but starts the epoch's data again. The clean job raises nothing; the resume is a
    ``data_cursor_reset`` at its first window, and only that."""
    require_module("transformers")
    hf = job(workdir, serve, "hf-four-ranks", request)
    hf.torchrun("hf_hooked.py", "--max_steps=12", "--output_dir=out-hf")
    hf.wait()
    steps = hf.rows("step_records")
    assert sorted((s["step"], s["rank"]) for s in steps) == [
        (t, r) for t in range(1, 13) for r in range(WORLD)
    ]
    hf.judged()
    assert hf.rows("incidents") == []
    resumed = job(workdir, serve, hf.run, request, hf.token)  # the same run, a new job
    resumed.torchrun("hf_hooked.py", "--max_steps=12", "--output_dir=out-hf",
                     "--resume_from=out-hf/checkpoint-6", "--ignore_data_skip")  # fmt: skip
    resumed.wait()
    restored = hf.rows("resume_events")
    assert len(restored) == WORLD and {r["restored"]["consumed"] for r in restored} == {0}
    hf.judged()
    critical = [f for f in hf.rows("findings") if f["severity"] == "critical"]
    assert {(f["kind"], f["step"]) for f in critical} == {("data_cursor_reset", 7)}, critical
    assert hf.dead_letters() == []  # the two jobs share the spool folder


def test_a_manual_optimization_module_attached_by_the_callback_line_stores_its_windows(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    require_module("lightning")
    module = job(workdir, serve, "lightning-manual", request, **TARGETS)
    module.python("lightning_hooked.py", "--max_steps=12")
    module.wait()
    steps = module.rows("step_records")
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert all(s["loss_sum"] is not None and s["grad_norm"] is not None for s in steps)
    assert all(s["tokens"] == 4 * 32 for s in steps)
    assert module.dead_letters() == []


def test_the_nanogpt_baseline_runs_without_the_hook(workdir: Path) -> None:
    """The baseline of the line count is a real trainer. (The other baselines differ from their
    hooked copies, which run above, only in the lines the counter shows: it reports any other
    difference as drift.)"""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(TRAINERS / "nanogpt_plain.py"), "--data_dir=data", "--max_iters=25",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=workdir, env=child_environ(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (workdir / "out" / "ckpt.pt").is_file()  # rank 0 saved at iteration 20
