"""The order the suite's files are handed to `make test`'s two workers: longest first.

pytest-xdist's ``--dist loadfile`` hands each worker whole files, one more whenever it runs
low, in collection order; by default it first reorders files by their number of tests, which
sends the few-test end-to-end files (the long ones) last, where one of them can keep a worker
busy for minutes after the other has finished. ``make test`` passes ``--no-loadscope-reorder``
and ``pytest_collection_modifyitems`` (tests/conftest.py) sorts the files by the seconds
below, longest first: the greedy longest-first schedule, whose make-span is at most 4/3 of the
best one.

The seconds are each file's total from ``pytest --durations=0`` in a clean worktree (setup,
call and teardown summed; ``make test`` of 859639b on 2026-12-08, ``-n 2 --dist loadfile``,
nothing else running, 2,662 s in all over 1,379 s of pytest; ``scripts/file_seconds.py LOG
--min 10``). Only
their order matters; a file not listed counts as 0 s and keeps its collection order after
the listed ones. ``tests/test_scheduling.py`` checks every listed file exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest

FILE_SECONDS: dict[str, float] = {
    "tests/test_attach_nanogpt.py": 338.9,
    "tests/test_drills.py": 231.4,
    "tests/test_attach_recipes.py": 180.8,
    "tests/test_recovery_e2e.py": 150.0,
    "tests/test_recovery_holds.py": 146.4,
    "tests/test_multinode.py": 132.9,
    "tests/test_collectors_transport.py": 118.0,
    "tests/test_demo.py": 95.6,
    "tests/test_replicas.py": 81.1,
    "tests/test_collectors_multirank.py": 79.6,
    "tests/test_api_schema.py": 74.4,
    "tests/test_attach_mnist.py": 70.1,
    "tests/test_judge_batches.py": 62.0,
    "tests/test_multinode_tutorial.py": 61.9,
    "tests/test_backtest.py": 60.8,
    "tests/test_attach_fabric.py": 60.8,  # alone, 2026-12-08; added after that run
    "tests/test_ingest_postgres_copy.py": 58.8,
    "tests/test_attach_accelerate.py": 55.0,
    "tests/test_restart_loop.py": 46.9,
    "tests/test_collectors_hf.py": 41.4,
    "tests/test_attach_imagenet.py": 41.2,
    "tests/test_prometheus.py": 35.2,
    "tests/test_collectors_shedding.py": 32.5,
    "tests/test_api.py": 30.7,
    "tests/test_attach_word_lm.py": 27.7,
    "tests/test_cli_proposals.py": 26.8,
    "tests/test_collectors_skip_update.py": 24.5,
    "tests/test_cli.py": 22.2,
    "tests/test_layers.py": 20.7,
    "tests/test_collectors_lightning.py": 20.1,
    "tests/test_collectors_no_silent_loss.py": 18.7,
    "tests/test_collectors_async_saves.py": 16.6,
    "tests/test_compile_hangs.py": 16.2,
    "tests/test_config.py": 15.1,
    "tests/test_collectors_agreement.py": 13.4,
    "tests/test_migrations.py": 12.1,
    "tests/test_collectors_directives.py": 11.3,
    "tests/test_collectors_relay.py": 10.8,
}


def file_of(item: pytest.Item, root: Path) -> str:
    return Path(item.path).resolve().relative_to(root).as_posix()


def longest_first(items: list[pytest.Item], root: Path) -> None:
    """Sort ``items`` in place by their file's seconds, longest first; stable otherwise."""
    items.sort(key=lambda item: -FILE_SECONDS.get(file_of(item, root), 0.0))
