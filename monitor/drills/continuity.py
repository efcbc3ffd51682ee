"""Local state continuity: N+M updates uninterrupted against N, a checkpoint, and a fresh
process resumed for M (the reference text's first drill).

Compared at N+M: weights, Adam moments (and their step counters), learning rates and each
rank's next sample ids; then the next gradient update (the weights' change from N+M to N+M+1),
which shows a lost moment or a restarted schedule even where the weights still look close.
"""

from __future__ import annotations

from monitor.drills import snapshots
from monitor.drills.context import DrillContext
from policies.drills import Check, compare_arrays, compare_ids, compare_numbers


def drill(context: DrillContext, checks: list[Check]) -> None:
    n, m = context.steps, context.resume_steps
    end = n + m
    reference_dir, first_dir, resumed_dir = (context.directory(d) for d in ("reference", "first", "resumed"))
    # one update past N+M, a checkpoint at each of the last two: the next gradient update
    # the reference and the first part are independent: run side by side
    context.run_together(
        {
            "reference": {"steps": end + 1, "checkpoint_dir": reference_dir, "save_every": 1},
            "first": {"steps": n, "checkpoint_dir": first_dir},
        }
    )
    context.run(
        "resumed",
        {
            "steps": end + 1,
            "checkpoint_dir": resumed_dir,
            "resume_from": snapshots.step_dir(first_dir, n),
            "save_every": 1,
        },
    )
    reference = snapshots.load(snapshots.step_dir(reference_dir, end))
    resumed = snapshots.load(snapshots.step_dir(resumed_dir, end))
    config = context.config
    checks.append(compare_arrays("weights", "weights", reference.model, resumed.model, config))
    checks.append(
        compare_arrays("adam_moments", "optimizer values", reference.optimizer, resumed.optimizer, config)
    )
    checks.append(
        compare_numbers("learning_rate", "learning rates", reference.state["lr"], resumed.state["lr"], config)
    )
    checks.append(compare_ids("next_sample_ids", reference.next_ids, resumed.next_ids))
    reference_next = snapshots.load(snapshots.step_dir(reference_dir, end + 1))
    resumed_next = snapshots.load(snapshots.step_dir(resumed_dir, end + 1))
    checks.append(
        compare_arrays(
            "next_update",
            "weight updates",
            snapshots.updates(reference, reference_next),
            snapshots.updates(resumed, resumed_next),
            config,
        )
    )
