"""The serving process's collector thresholds (``monitor.garbage``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from monitor.errors import ConfigError
from monitor.garbage import GarbageConfig, apply
from monitor.settings import service_config


@pytest.fixture(autouse=True)
def restored_thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_apply_sets_the_thresholds_and_returns_those_before() -> None:
    gc.set_threshold(700, 10, 10)
    assert apply(GarbageConfig(gen0_threshold=12_345, gen1_threshold=7, gen2_threshold=3)) == (700, 10, 10)
    assert gc.get_threshold() == (12_345, 7, 3)


def test_disabled_leaves_the_interpreter_as_it_is() -> None:
    gc.set_threshold(700, 10, 10)
    apply(GarbageConfig(enabled=False, gen0_threshold=50_000))
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.isenabled()


def test_the_default_collects_less_often_than_cpython() -> None:
    assert GarbageConfig().gen0_threshold > 700


def test_a_setting_from_the_environment_and_a_refused_one() -> None:
    config = service_config({"RUNHEALTH_GARBAGE__GEN0_THRESHOLD": "5000"})
    assert config.garbage == GarbageConfig(gen0_threshold=5000)
    with pytest.raises(ConfigError, match="every threshold must be >= 1"):
        service_config({"RUNHEALTH_GARBAGE__GEN0_THRESHOLD": "0"})
