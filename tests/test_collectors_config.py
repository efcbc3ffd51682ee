"""The trainer side's configuration: one reader of RUNHEALTH_* (an injected mapping), the
shared yes/no spelling, and an explicit config merged over the environment's, not instead."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from collectors import RunHealth, RunHealthConfig
from collectors.config import ConfigError, HookConfig, default_run_name
from collectors.layout import data_parallel, discover_identity
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.transport import TransportConfig
from collectors.variables import FLAT_NAMES
from monitor.settings import service_config
from monitor.settings.layout import TRAINER_SECTIONS
from policies.protocol import RUN_NAME, value_problem
from tests.collectors_support import child_environ, serving, step_rows
from tests.support import require_module

SERVICE = {
    "RUNHEALTH_URL": "http://monitor:8765",
    "RUNHEALTH_TOKEN": "rh_run_tok",
    "RUNHEALTH_RUN": "policy-sft-v4",
}


def test_every_component_field_is_a_variable_in_any_case() -> None:
    config = RunHealthConfig.from_environ(
        {
            "RUNHEALTH_HOOK__SHIFT_LABELS": "0",
            "RUNHEALTH_HOOK__IGNORE_INDEX": "-1",
            "runhealth_sender__flush_interval_s": " 0.5 ",
            "RUNHEALTH_SPOOL__FSYNC": "off",
            "RUNHEALTH_TRANSPORT__TIMEOUT_S": "3",
            "RUNHEALTH_DIRECTIVES__POLL_INTERVAL_S": "",  # empty: unset
        }
    )
    assert (config.hook.shift_labels, config.hook.ignore_index) == (False, -1)
    assert config.sender == dataclasses.replace(SenderConfig(), flush_interval_s=0.5)
    assert config.spool == SpoolConfig(fsync=False)
    assert config.transport == TransportConfig(timeout_s=3.0)
    assert config.directives == RunHealthConfig().directives


def test_the_flat_names_and_the_component_names_are_one_setting() -> None:
    flat = RunHealthConfig.from_environ({"RUNHEALTH_SPOOL_DIR": "/var/spool/rh"})
    named = RunHealthConfig.from_environ({"RUNHEALTH_SPOOL__DIRECTORY": "/var/spool/rh"})
    assert flat == named and flat.spool.directory == "/var/spool/rh"
    with pytest.raises(ConfigError, match="RUNHEALTH_SPOOL_DIR and RUNHEALTH_SPOOL__DIRECTORY"):
        RunHealthConfig.from_environ({"RUNHEALTH_SPOOL_DIR": "/a", "RUNHEALTH_SPOOL__DIRECTORY": "/b"})
    components = {item.name for item in dataclasses.fields(RunHealthConfig)}
    assert {component for component, _ in FLAT_NAMES.values()} <= components


@pytest.mark.parametrize(
    ("word", "value"), [("1", True), ("YES", True), ("On", True), ("false", False), ("No", False)]
)
def test_a_yes_or_no_is_spelled_as_on_the_service(word: str, value: bool) -> None:
    assert (
        RunHealthConfig.from_environ({"RUNHEALTH_HOOK__CANARY_ON_CHECKPOINT": word}).hook.canary_on_checkpoint
        is value
    )
    assert service_config({"RUNHEALTH_QUARANTINE_LIVE": word}).decisions.actions.live is value


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"RUNHEALTH_HOOK__SHIFT_LABELS": "ture"},
            "RUNHEALTH_HOOK__SHIFT_LABELS must be one of 1/true/yes/on",
        ),
        ({"RUNHEALTH_HEARTBEAT_S": "often"}, "RUNHEALTH_HEARTBEAT_S must be a number, got 'often'"),
        (
            {"RUNHEALTH_SENDER__FLUSH_INTERVAL_S": "inf"},
            "RUNHEALTH_SENDER__FLUSH_INTERVAL_S must be a finite",
        ),
        ({"RUNHEALTH_RING__SLOTS": "8.5"}, "RUNHEALTH_RING__SLOTS must be an integer"),
        ({"RUNHEALTH_HOOK__AGREE_EVERY": "0"}, "RUNHEALTH_HOOK__AGREE_EVERY='0': HookConfig.agree_every"),
        ({"RUNHEALTH_HOOK__SHIFT_LABLES": "0"}, "RUNHEALTH_HOOK__SHIFT_LABLES is not a setting of the hook"),
        ({"RUNHEALTH_URL": "monitor:8765"}, "RUNHEALTH_URL='monitor:8765': RUNHEALTH_URL must be an http"),
    ],
)
def test_a_bad_value_names_its_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunHealthConfig.from_environ(environ)


def test_the_services_variables_are_left_to_the_service() -> None:
    """The embedded service inherits the trainer's environment: each side reads its own
    sections and leaves the other's alone."""
    environ = {
        "RUNHEALTH_POLICIES__SPIKE__Z": "9",
        "RUNHEALTH_QUARANTINE__LIVE": "1",
        "RUNHEALTH_HOOK__SHIFT_LABELS": "0",
    }
    assert RunHealthConfig.from_environ(environ) == RunHealthConfig(hook=HookConfig(shift_labels=False))
    assert service_config(environ).engine.series.loss_spike.z == 9.0
    assert TRAINER_SECTIONS == {item.name for item in dataclasses.fields(RunHealthConfig)}


def test_the_flight_recorder_switch_and_its_override() -> None:
    assert RunHealthConfig.from_environ({"TORCH_FR_BUFFER_SIZE": "2000"}).hook.nccl_trace is True
    assert RunHealthConfig.from_environ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}).hook.nccl_trace is False
    overridden = {"TORCH_FR_BUFFER_SIZE": "2000", "RUNHEALTH_HOOK__NCCL_TRACE": "off"}
    assert RunHealthConfig.from_environ(overridden).hook.nccl_trace is False


# An explicit config and the environment merge.


def test_an_explicit_config_keeps_what_the_environment_set_and_it_did_not() -> None:
    explicit = RunHealthConfig(hook=HookConfig(shift_labels=False))
    config = RunHealthConfig.from_environ({**SERVICE, "RUNHEALTH_HEARTBEAT_S": "2.5"}, explicit=explicit)
    assert (config.transport.url, config.transport.token, config.transport.run) == tuple(SERVICE.values())
    assert config.hook == HookConfig(shift_labels=False)
    assert config.sender.heartbeat_interval_s == 2.5


def test_what_an_explicit_config_sets_wins_over_the_environment() -> None:
    explicit = RunHealthConfig(
        transport=TransportConfig(run="explicit-run"),
        sender=dataclasses.replace(SenderConfig(), heartbeat_interval_s=1.0, flush_interval_s=0.25),
    )
    config = RunHealthConfig.from_environ({**SERVICE, "RUNHEALTH_HEARTBEAT_S": "2.5"}, explicit=explicit)
    assert (config.transport.url, config.transport.run) == (SERVICE["RUNHEALTH_URL"], "explicit-run")
    assert (config.sender.heartbeat_interval_s, config.sender.flush_interval_s) == (1.0, 0.25)
    assert RunHealthConfig.from_environ({}, explicit=explicit) == explicit
    assert RunHealthConfig.from_environ(SERVICE, explicit=None) == RunHealthConfig.from_environ(SERVICE)


def test_the_hook_merges_its_config_argument_over_its_environment() -> None:
    rh = RunHealth(config=RunHealthConfig(hook=HookConfig(shift_labels=False)), environ=SERVICE)
    assert rh.config.transport == TransportConfig(*SERVICE.values())
    assert rh.config.hook.shift_labels is False


def test_the_node_name_is_read_with_the_same_rule() -> None:
    torch = require_module("torch")
    device = torch.device("cpu")
    named = discover_identity(torch, {"RUNHEALTH_NODE": " node-7 "}, device=device, hostname=lambda: "host")
    unnamed = discover_identity(torch, {"RUNHEALTH_NODE": " "}, device=device, hostname=lambda: "host")
    assert (named.node, unnamed.node) == ("node-7", "host")
    assert named.layout == data_parallel(0, 1)


@pytest.mark.slow
def test_a_config_argument_no_longer_drops_the_service_from_the_environment(tmp_path: Path) -> None:
    """``config=`` set one hook field: the hook used to forget RUNHEALTH_URL, RUNHEALTH_TOKEN and
    RUNHEALTH_RUN, start an embedded service of its own and store the windows there."""
    require_module("torch")
    (tmp_path / "serve").mkdir()
    with serving(tmp_path / "serve") as serve:
        token = serve.create_run("merged")
        environ = child_environ(
            RUNHEALTH_URL=serve.url,
            RUNHEALTH_TOKEN=token,
            RUNHEALTH_RUN="merged",
            RUNHEALTH_SPOOL_DIR=str(tmp_path / "spool"),
            RUNHEALTH_DB=str(tmp_path / "embedded.db"),
        )
        config = RunHealthConfig(hook=HookConfig(shift_labels=False))
        rh = RunHealth(config=config, environ=environ).start()
        for _ in range(3):
            rh.window_start()
            rh.loss(1.5, tokens=3)
            rh.window_end()
        rh.close()
        assert rh.embedded_pid is None and rh.counters["sent"] == 5  # run start, 3 steps, finish
        assert [row["attempt"] for row in step_rows(serve.db, "merged")] == [1, 2, 3]
    assert not (tmp_path / "embedded.db").exists()


@pytest.mark.parametrize("name", ["a b", "../x", "a/b", "a?b", 'say"hi"', "-lead"])
def test_a_run_name_the_service_would_refuse_is_a_config_error_at_once(name: str) -> None:
    """Such names were spooled forever or dead-lettered batch after batch: the API refuses them
    (and ``runhealth runs create`` too, from the same rule)."""
    with pytest.raises(ConfigError, match="not a run name"):
        RunHealthConfig.from_environ({"RUNHEALTH_RUN": name, "RUNHEALTH_URL": "http://127.0.0.1:1"})


def test_a_launchers_job_id_becomes_a_run_name_the_service_takes() -> None:
    assert default_run_name({"TORCHELASTIC_RUN_ID": "job/7 retry"}, 0.0) == "run-job-7-retry"
    assert default_run_name({"SLURM_JOB_ID": "123_4"}, 0.0) == "slurm-123_4"
    assert value_problem(RUN_NAME, default_run_name({"TORCHELASTIC_RUN_ID": "x" * 500}, 0.0)) is None
