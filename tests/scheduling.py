"""The order the suite's files are handed to `make test`'s two workers: longest first.

pytest-xdist's ``--dist loadfile`` hands each worker whole files, one more whenever it runs
low, in collection order; by default it first reorders files by their number of tests, which
sends the few-test end-to-end files (the long ones) last, where one of them can keep a worker
busy for minutes after the other has finished. ``make test`` passes ``--no-loadscope-reorder``
and ``pytest_collection_modifyitems`` (tests/conftest.py) sorts the files by the seconds
below, longest first: the greedy longest-first schedule, whose make-span is at most 4/3 of the
best one.

The seconds are each file's total from ``pytest --durations=0`` in a clean worktree (setup,
call and teardown summed; ``make test`` of 03f6a78 on 2026-12-07, ``-n 2 --dist loadfile``,
nothing else running, 1,151 s in all; ``scripts/file_seconds.py LOG --min 10``). Only
their order matters; a file not listed counts as 0 s and keeps its collection order after
the listed ones. ``tests/test_scheduling.py`` checks every listed file exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest

FILE_SECONDS: dict[str, float] = {
    "tests/test_attach_nanogpt.py": 274.1,
    "tests/test_drills.py": 197.5,
    "tests/test_attach_recipes.py": 156.2,
    "tests/test_multinode.py": 118.0,
    "tests/test_recovery_e2e.py": 102.2,
    "tests/test_recovery_holds.py": 99.2,
    "tests/test_demo.py": 88.0,
    "tests/test_collectors_transport.py": 86.7,
    "tests/test_collectors_multirank.py": 73.5,
    "tests/test_attach_mnist.py": 73.3,
    "tests/test_backtest.py": 67.0,
    "tests/test_multinode_tutorial.py": 65.0,
    "tests/test_ingest_postgres_copy.py": 54.5,
    "tests/test_replicas.py": 54.4,
    "tests/test_judge_batches.py": 51.1,
    "tests/test_attach_accelerate.py": 50.6,
    "tests/test_restart_loop.py": 50.5,
    "tests/test_api_schema.py": 44.4,
    "tests/test_collectors_hf.py": 40.9,
    "tests/test_attach_imagenet.py": 39.7,
    "tests/test_attach_word_lm.py": 31.4,
    "tests/test_collectors_shedding.py": 27.0,
    "tests/test_cli_proposals.py": 25.6,
    "tests/test_collectors_async_saves.py": 25.3,
    "tests/test_prometheus.py": 24.4,
    "tests/test_api.py": 22.0,
    "tests/test_collectors_skip_update.py": 18.8,
    "tests/test_collectors_lightning.py": 18.6,
    "tests/test_collectors_no_silent_loss.py": 18.2,
    "tests/test_cli.py": 17.2,
    "tests/test_config.py": 15.9,
    "tests/test_layers.py": 15.6,
    "tests/test_collectors_agreement.py": 13.2,
    "tests/test_collectors_relay.py": 10.3,
}


def file_of(item: pytest.Item, root: Path) -> str:
    return Path(item.path).resolve().relative_to(root).as_posix()


def longest_first(items: list[pytest.Item], root: Path) -> None:
    """Sort ``items`` in place by their file's seconds, longest first; stable otherwise."""
    items.sort(key=lambda item: -FILE_SECONDS.get(file_of(item, root), 0.0))
