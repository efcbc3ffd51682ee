"""Distributed topology restoration: save on 2 ranks, load on 4 (the reference text's second
drill, its 4-to-8 GPUs scaled to gloo processes on the CPU).

The 4-rank run resumes from the 2-rank checkpoint with nothing left to train (``steps`` = the
checkpoint's step), so it saves at once what it restored, resharded by its own layout; both
checkpoints are gathered name by name and compared. The data partition is judged on the next
sample ids each layout's ranks would read; the peak restore memory is each restoring rank's
peak resident set over that run (restore and save: nothing else runs in it).
"""

from __future__ import annotations

from monitor.drills import snapshots
from monitor.drills.context import DrillContext
from policies.drills import Check, compare_arrays, compare_numbers, memory, partition

SAVE_RANKS = 2
LOAD_RANKS = 4


def drill(context: DrillContext, checks: list[Check]) -> None:
    n = context.steps
    saved_dir, restored_dir = context.directory("saved-2"), context.directory("restored-4")
    context.run("saved-2", {"steps": n, "checkpoint_dir": saved_dir}, nproc=SAVE_RANKS)
    source = snapshots.step_dir(saved_dir, n)
    restore = context.run(
        "restored-4", {"steps": n, "checkpoint_dir": restored_dir, "resume_from": source}, nproc=LOAD_RANKS
    )
    saved = snapshots.load(source)
    restored = snapshots.load(snapshots.step_dir(restored_dir, n))
    config = context.config
    shape = f" ({SAVE_RANKS} ranks -> {LOAD_RANKS})"
    model = compare_arrays("resharded_model", "weights", saved.model, restored.model, config)
    checks.append(_named(model, shape))
    optimizer = compare_arrays(
        "resharded_optimizer", "optimizer values", saved.optimizer, restored.optimizer, config
    )
    checks.append(_named(optimizer, shape))
    checks.append(
        compare_numbers("learning_rate", "learning rates", saved.state["lr"], restored.state["lr"], config)
    )
    checks.append(partition("data_partition", saved.next_ids, restored.next_ids))
    checks.append(memory("peak_restore_memory", restore.peak_rss_mib, config.restore_memory_budget_mib))


def _named(check: Check, suffix: str) -> Check:
    return Check(check.name, check.passed, check.detail + suffix, check.measured)
