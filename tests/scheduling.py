"""The order the suite's files are handed to `make test`'s two workers: longest first.

pytest-xdist's ``--dist loadfile`` hands each worker whole files, one more whenever it runs
low, in collection order; by default it first reorders files by their number of tests, which
sends the few-test end-to-end files (the long ones) last, where one of them can keep a worker
busy for minutes after the other has finished. ``make test`` passes ``--no-loadscope-reorder``
and ``pytest_collection_modifyitems`` (tests/conftest.py) sorts the files by the seconds
below, longest first: the greedy longest-first schedule, whose make-span is at most 4/3 of the
best one.

The seconds are each file's total from ``pytest --durations=0`` in a clean worktree (setup,
call and teardown summed; the run of 2026-12-02 under load, ``-n 2 --dist loadfile``, and for
the files added on 2026-12-03 two runs of them alone at load 5-9). Only
their order matters; a file not listed counts as 0 s and keeps its collection order after
the listed ones. ``tests/test_scheduling.py`` checks every listed file exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest

FILE_SECONDS: dict[str, float] = {
    # split on 2026-12-07: the nanoGPT rollback and resume tests were 320 of the file's 471 s in a
    # clean run, then cut by about a quarter of their CPU; both scaled to this table's 245.6
    "tests/test_attach_nanogpt.py": 170.0,
    "tests/test_attach_recipes.py": 80.0,
    "tests/test_drills.py": 172.5,
    "tests/test_recovery_e2e.py": 146.3,
    "tests/test_recovery_holds.py": 135.1,
    "tests/test_collectors_multirank.py": 108.8,
    "tests/test_multinode.py": 87.2,  # scaled by its after/before (mean of 3 afters), 2026-12-04
    "tests/test_collectors_transport.py": 71.4,
    "tests/test_judge_batches.py": 63.7,
    "tests/test_collectors_async_saves.py": 60.5,
    "tests/test_demo.py": 60.0,
    "tests/test_multinode_tutorial.py": 53.8,  # alone beside two busy processes, 2026-12-04
    "tests/test_attach_mnist.py": 55.0,  # 120-150 s for 4 tests at load 7-11 (now 3), 2026-12-07
    "tests/test_attach_imagenet.py": 50.0,  # 50-62 s beside other helpers' runs, load 10-11, 2026-12-04
    "tests/test_collectors_hf.py": 47.4,
    "tests/test_replicas.py": 44.3,  # scaled by its after/before, measured back to back, 2026-12-04
    "tests/test_restart_loop.py": 37.1,
    "tests/test_attach_word_lm.py": 36.0,  # 26-39 s beside other helpers' runs, load 5-10, 2026-12-04
    "tests/test_attach_accelerate.py": 30.9,  # alone beside two busy processes, 2026-12-04
    "tests/test_ingest_postgres_copy.py": 30.4,  # scaled by its after/before, measured back to back, 2026-12-04
    "tests/test_collectors_skip_update.py": 30.4,
    "tests/test_collectors_agreement.py": 28.1,
    "tests/test_config.py": 25.3,
    "tests/test_collectors_shedding.py": 23.0,
    "tests/test_api.py": 21.7,  # scaled by its after/before, measured back to back, 2026-12-04
    "tests/test_prometheus.py": 20.7,
    "tests/test_cli_proposals.py": 19.1,  # scaled by its after/before, measured back to back, 2026-12-04
    "tests/test_store_retention.py": 18.2,
    "tests/test_store_usage.py": 17.8,
    "tests/test_collectors_lightning.py": 16.6,
    "tests/test_decisions.py": 10.4,  # scaled by its after/before, measured back to back, 2026-12-04
}


def file_of(item: pytest.Item, root: Path) -> str:
    return Path(item.path).resolve().relative_to(root).as_posix()


def longest_first(items: list[pytest.Item], root: Path) -> None:
    """Sort ``items`` in place by their file's seconds, longest first; stable otherwise."""
    items.sort(key=lambda item: -FILE_SECONDS.get(file_of(item, root), 0.0))
