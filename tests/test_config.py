"""The service's settings: defaults, a TOML file, the environment (an injected mapping), in
that order; one boolean spelling; one clear error naming what set a bad value."""

import dataclasses
import json
import os
import random
import subprocess
import sys
import typing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from monitor.api.server import prepare_store
from monitor.config import ConfigError, ServiceConfig
from monitor.ingest.schemas import BatchIn
from monitor.observe.tracing import Tracing
from monitor.settings import read_settings, service_config
from monitor.settings.layout import NOT_SETTINGS, leaves, value_at
from monitor.store import queries
from policies.flags import FALSE_WORDS, TRUE_WORDS, FlagError, parse_flag
from policies.proposals import ContinuationPolicy
from policies.types import Severity


def setting(environ: dict[str, str], name: str, file: str | None = None) -> Any:
    return next(s for s in read_settings(environ, file).settings if s.name == name)


def config_leaves(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every scalar field below ``node``, found without the settings' own walk."""
    for item in dataclasses.fields(node):
        value = getattr(node, item.name)
        if dataclasses.is_dataclass(value):
            yield from config_leaves(value, (*path, item.name))
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for key, entry in value.items():
                yield from config_leaves(entry, (*path, item.name, key))
        else:
            yield (*path, item.name)


def test_every_field_of_every_config_is_a_setting() -> None:
    targets = {leaf.target for leaf in leaves()}
    expected = {path for path in config_leaves(ServiceConfig()) if path[:2] not in NOT_SETTINGS}
    assert len(expected) > 100
    assert targets == expected
    assert len({leaf.variable for leaf in leaves()}) == len(targets)


# Pure verdicts in policies/ that judge no run: a restart drill's tolerances (policies.drills)
# are read by `runhealth drill`, under their own section.
NOT_RULES = frozenset({"drills"})


def test_every_policy_config_is_under_policies() -> None:
    """A config defined in policies/ is a detection or recovery rule's: its settings are found
    under ``policies``, wherever the service nests it (a new one needs a line in SECTIONS)."""
    config = ServiceConfig()
    for leaf in leaves():
        owner = type(value_at(config, leaf.target[:-1]))
        if owner.__module__.startswith("policies.") and leaf.name[0] not in NOT_RULES:
            assert leaf.name[0] == "policies", (leaf.dotted, owner.__name__)


def test_a_threshold_from_the_environment() -> None:
    config = service_config({"RUNHEALTH_POLICIES__SPIKE__Z": "9.5"})
    assert config.engine.series.loss_spike.z == 9.5
    assert config.engine.series.grad_norm_spike == ServiceConfig().engine.series.grad_norm_spike
    assert (
        dataclasses.replace(config.engine.series.loss_spike, z=14.0)
        == ServiceConfig().engine.series.loss_spike
    )


def test_the_environment_names_are_any_case_and_empty_is_unset() -> None:
    config = service_config({"runhealth_policies__rank_loss__z": " 7 ", "RUNHEALTH_POLICIES__SPIKE__Z": ""})
    assert config.engine.rank_loss.z == 7.0
    assert config.engine.series.loss_spike.z == 14.0


def test_defaults_read_back_unchanged_through_every_variable() -> None:
    """Each setting's default, written as the environment would spell it, parses back to the
    default: every type (numbers, words, lists, enums, yes/no) has an environment spelling."""

    def spelled(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "off"
        if isinstance(value, tuple | frozenset):
            return ",".join(sorted(value) if isinstance(value, frozenset) else value)
        if isinstance(value, Severity | ContinuationPolicy):
            return str(value.value)
        return repr(value) if isinstance(value, float) else str(value)

    environ = {leaf.variable: spelled(leaf.default) for leaf in leaves() if leaf.default is not None}
    environ = {k: v for k, v in environ.items() if v}  # an empty set is unset
    effective = read_settings(environ)
    assert effective.config == ServiceConfig()
    sources = {s.name: s.source for s in effective.settings}
    assert sources["policies.spike.z"] == "environment"
    assert sources["policies.devices.device_limits.nvlink_crc.floor_per_s"] == "environment"


def test_a_nested_setting_below_a_table() -> None:
    config = service_config({"RUNHEALTH_POLICIES__DEVICES__DEVICE_LIMITS__PCIE_REPLAY__MIN_COUNT": "4"})
    assert config.devices.device_limits["pcie_replay"].min_count == 4
    assert config.devices.device_limits["nvlink_crc"] == ServiceConfig().devices.device_limits["nvlink_crc"]


def test_lists_enums_and_words() -> None:
    config = service_config(
        {
            "RUNHEALTH_POLICIES__STRAGGLERS__PHASES": "forward, backward",
            "RUNHEALTH_POLICIES__PROPOSALS__AUTO_APPROVE": "hang,straggler",
            "RUNHEALTH_POLICIES__PROPOSALS__UNDETERMINED": "skip_window",
            "RUNHEALTH_POLICIES__DEVICES__UNKNOWN_XID_SEVERITY": "critical",
            "RUNHEALTH_POLICIES__GRAD_NORM_SPIKE__NOISE": "steps",
        }
    )
    assert config.engine.stragglers.phases == ("forward", "backward")
    assert config.decisions.proposals.auto_approve == frozenset({"hang", "straggler"})
    assert config.decisions.proposals.undetermined is ContinuationPolicy.SKIP_WINDOW
    assert config.devices.unknown_xid_severity is Severity.CRITICAL
    assert config.engine.series.grad_norm_spike.noise == "steps"


def test_the_legacy_flat_names_still_set_their_settings() -> None:
    config = service_config(
        {
            "RUNHEALTH_HANG_MIN_TIMEOUT_S": "12.5",
            "RUNHEALTH_MAX_BATCH_RECORDS": "10",
            "RUNHEALTH_QUARANTINE_COMMAND": "kubectl cordon {node}",
            "RUNHEALTH_DB": "sqlite:///x.db",
            "RUNHEALTH_ADMIN_TOKEN": "rh_admin_x",
        }
    )
    assert config.engine.hangs.min_timeout_s == 12.5
    assert config.ingest.max_batch_records == 10
    assert config.decisions.actions.command == "kubectl cordon {node}"
    assert (config.db, config.admin_token) == ("sqlite:///x.db", "rh_admin_x")
    row = setting({"RUNHEALTH_HANG_MIN_TIMEOUT_S": "12.5"}, "policies.hangs.min_timeout_s")
    assert (row.source, row.origin, row.variable) == (
        "environment",
        "RUNHEALTH_HANG_MIN_TIMEOUT_S",
        "RUNHEALTH_POLICIES__HANGS__MIN_TIMEOUT_S",
    )
    with pytest.raises(ConfigError, match="RUNHEALTH_HANG_MIN_TIMEOUT_S and RUNHEALTH_POLICIES__HANGS"):
        service_config({"RUNHEALTH_HANG_MIN_TIMEOUT_S": "1", "RUNHEALTH_POLICIES__HANGS__MIN_TIMEOUT_S": "2"})


def test_the_preemption_warning_is_read_from_its_own_name_and_refused_when_not_a_notice() -> None:
    assert service_config({"RUNHEALTH_PREEMPTION_WARNING_S": "120"}).engine.preemption.warning_s == 120.0
    assert service_config({}).engine.preemption.warning_s is None  # no budget until it is set
    margin = service_config({"RUNHEALTH_POLICIES__PREEMPTION__MARGIN_S": "2"}).engine.preemption
    assert margin.margin_s == 2.0
    with pytest.raises(ConfigError, match=r"RUNHEALTH_PREEMPTION_WARNING_S.*positive"):
        service_config({"RUNHEALTH_PREEMPTION_WARNING_S": "0"})


def test_other_runhealth_variables_are_not_the_services() -> None:
    """The trainer's and the CLI's own variables share the prefix; the service ignores them."""
    environ = {
        "RUNHEALTH_URL": "http://x",
        "RUNHEALTH_TOKEN": "t",
        "RUNHEALTH_NODE": "n",
        "RUNHEALTH_SPOOL_DIR": "/s",
        "RUNHEALTH_OPERATOR_TOKEN": "o",
        "RUNHEALTH_HOOK__SHIFT_LABELS": "0",
        "RUNHEALTH_SENDER__FLUSH_INTERVAL_S": "1",
    }
    assert service_config(environ) == ServiceConfig()


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_settings_file(tmp_path: Path) -> None:
    file = write(
        tmp_path / "runhealth.toml",
        "[policies.spike]\nz = 11\nwindow = 60\n\n[quarantine]\nlive = true\n"
        '[policies.stragglers]\nphases = ["forward"]\n[policies.devices.device_limits.nvlink_crc]\nfloor_per_s = 5\n',
    )
    config = service_config({}, file)
    assert (config.engine.series.loss_spike.z, config.engine.series.loss_spike.window) == (11.0, 60)
    assert config.decisions.actions.live is True
    assert config.engine.stragglers.phases == ("forward",)
    assert config.devices.device_limits["nvlink_crc"].floor_per_s == 5.0
    row = setting({}, "policies.spike.z", file)
    assert (row.source, row.origin, row.value) == ("file", file, 11.0)


def test_the_environment_wins_over_the_file_which_wins_over_defaults(tmp_path: Path) -> None:
    file = write(tmp_path / "r.toml", "[policies.spike]\nz = 11\nwindow = 60\n")
    environ = {"RUNHEALTH_CONFIG": file, "RUNHEALTH_POLICIES__SPIKE__Z": "12"}
    spike = service_config(environ).engine.series.loss_spike
    assert (spike.z, spike.window, spike.warmup) == (12.0, 60, 50)
    rows = {s.name: s for s in read_settings(environ).settings}
    assert rows["policies.spike.z"].origin == "RUNHEALTH_POLICIES__SPIKE__Z"
    assert rows["policies.spike.window"].source == "file"
    assert rows["policies.spike.warmup"].source == "default"


def test_an_explicit_file_wins_over_the_variable(tmp_path: Path) -> None:
    chosen = write(tmp_path / "chosen.toml", "[policies.rank_loss]\nz = 3\n")
    named = write(tmp_path / "named.toml", "[policies.rank_loss]\nz = 4\n")
    effective = read_settings({"RUNHEALTH_CONFIG": named}, chosen)
    assert (effective.config.engine.rank_loss.z, effective.file) == (3.0, chosen)


def test_the_store_option_wins_over_the_settings() -> None:
    assert service_config({"RUNHEALTH_DB": "a.db"}, db="b.db").db == "b.db"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"RUNHEALTH_POLICIES__SPIKE__Z": "high"},
            "RUNHEALTH_POLICIES__SPIKE__Z must be a number, got 'high'",
        ),
        (
            {"RUNHEALTH_POLICIES__SPIKE__WINDOW": "1.5"},
            "RUNHEALTH_POLICIES__SPIKE__WINDOW must be an integer",
        ),
        ({"RUNHEALTH_POLICIES__SPIKE__Z": "nan"}, "RUNHEALTH_POLICIES__SPIKE__Z must be a finite number"),
        ({"RUNHEALTH_POLICIES__SPIKE__Z": "-1"}, r"RUNHEALTH_POLICIES__SPIKE__Z=-1.0: SpikeConfig: z > 0"),
        (
            {"RUNHEALTH_POLICIES__SPIKE__NOISE": "loud"},
            "RUNHEALTH_POLICIES__SPIKE__NOISE must be 'level' or 'steps'",
        ),
        ({"RUNHEALTH_POLICIES__SPIKE__ZED": "1"}, "RUNHEALTH_POLICIES__SPIKE__ZED is not a setting"),
        ({"RUNHEALTH_POLCIES__SPIKE__Z": "1"}, "RUNHEALTH_POLCIES__SPIKE__Z is not a setting"),
        ({"RUNHEALTH_POLICIES__SPIKE": "1"}, "RUNHEALTH_POLICIES__SPIKE names a section"),
        ({"RUNHEALTH_QUARANTINE_LIVE": "ture"}, "RUNHEALTH_QUARANTINE_LIVE must be one of 1/true/yes/on"),
        (
            {"RUNHEALTH_METRICS_LINK_SERIES": "device"},
            "RUNHEALTH_METRICS_LINK_SERIES='device': MetricsConfig",
        ),
        ({"RUNHEALTH_MAX_BATCH_BYTES": "10"}, "RUNHEALTH_MAX_BATCH_BYTES=10: IngestConfig"),
        (
            {"RUNHEALTH_POLICIES__SPIKE__WINDOW": "10", "RUNHEALTH_POLICIES__SPIKE__WARMUP": "20"},
            "SpikeConfig.warmup must be in",
        ),
        ({"RUNHEALTH_CONFIG": "/nonexistent/runhealth.toml"}, "/nonexistent/runhealth.toml does not exist"),
    ],
)
def test_a_bad_value_is_one_error_naming_what_set_it(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_settings(environ)


def test_a_bad_value_in_the_file_names_the_file_and_key(tmp_path: Path) -> None:
    file = write(tmp_path / "r.toml", '[policies.hangs]\nmin_timeout_s = "soon"\n')
    with pytest.raises(ConfigError, match=r"r.toml: policies.hangs.min_timeout_s must be a number"):
        read_settings({}, file)
    typo = write(tmp_path / "t.toml", "[policies.spike]\nzz = 1\n")
    with pytest.raises(ConfigError, match=r"t.toml: policies.spike.zz is not a setting"):
        read_settings({}, typo)
    broken = write(tmp_path / "b.toml", "[policies.spike\n")
    with pytest.raises(ConfigError, match=r"b\.toml is not valid TOML"):
        read_settings({}, broken)


@pytest.mark.parametrize("word", [*TRUE_WORDS, "TRUE", " Yes ", "On"])
def test_true_is_spelled_one_way(word: str) -> None:
    assert parse_flag(word, "X") is True
    assert service_config({"RUNHEALTH_QUARANTINE__LIVE": word}).decisions.actions.live is True


@pytest.mark.parametrize("word", [*FALSE_WORDS, "FALSE", " No ", "Off"])
def test_false_is_spelled_one_way(word: str) -> None:
    assert parse_flag(word, "X") is False
    assert service_config({"RUNHEALTH_QUARANTINE_LIVE": word}).decisions.actions.live is False


@pytest.mark.parametrize("word", ["ture", "enabled", "2", "y", "t"])
def test_any_other_spelling_is_an_error(word: str) -> None:
    with pytest.raises(FlagError, match="X must be one of"):
        parse_flag(word, "X")
    with pytest.raises(ConfigError, match="RUNHEALTH_POLICIES__SPIKE__LOG_SCALE must be one of"):
        service_config({"RUNHEALTH_POLICIES__SPIKE__LOG_SCALE": word})
    with pytest.raises(ConfigError, match="OTEL_SDK_DISABLED must be one of"):
        Tracing.from_environ({"OTEL_SDK_DISABLED": word, "OTEL_TRACES_EXPORTER": "console"})


def test_tracing_is_switched_off_by_any_true_spelling() -> None:
    for word in ("1", "YES", "on"):
        assert (
            Tracing.from_environ({"OTEL_SDK_DISABLED": word, "OTEL_TRACES_EXPORTER": "console"}).enabled
            is False
        )


def test_the_admin_token_is_never_shown() -> None:
    assert setting({"RUNHEALTH_ADMIN_TOKEN": "rh_admin_secret"}, "admin_token").value == "(set)"
    assert setting({}, "admin_token").value is None


def test_every_shown_value_is_plain_json() -> None:
    rows = read_settings({}).settings
    json.dumps([dataclasses.asdict(row) for row in rows])
    assert {row.source for row in rows} == {"default"}
    kinds = {typing.get_origin(leaf.kind) for leaf in leaves()}
    assert frozenset in kinds and tuple in kinds


# A threshold set by the environment reaches the engine that judges.

INCARNATION = str(uuid.uuid4())


def spike_incidents(tmp_path: Path, environ: dict[str, str], bad_loss: float) -> list[tuple[str, int]]:
    """The spike incidents a real Service, built as ``runhealth serve`` builds it, opens for a
    loss of 2.0 with noise (sd 0.02) and one bad batch at step 60."""
    noise = random.Random(7)
    environ = {**environ, "RUNHEALTH_DB": str(tmp_path / f"{uuid.uuid4().hex}.db")}
    service = prepare_store(service_config(environ), environ)
    with service.engine.begin() as connection:
        queries.create_run(connection, "r")
        run_id = int(queries.run_row(connection, "r").id)
    records: list[dict[str, Any]] = [
        {"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 1}
    ]
    for attempt in range(1, 100):
        loss = bad_loss if attempt == 60 else 2.0 + noise.gauss(0.0, 0.02)
        records.append(
            {
                "kind": "step",
                "incarnation": INCARNATION,
                "rank": 0,
                "attempt": attempt,
                "step": attempt,
                "time": float(attempt),
                "tokens": 10,
                "loss_sum": 10 * loss,
            }
        )
    service.ingest("r", run_id, BatchIn.model_validate_json(json.dumps({"records": records})).records)
    with service.engine.connect() as connection:
        rows = queries.list_incidents(connection, queries.IncidentFilter(run="r"))
    service.engine.dispose()
    return [(row["kind"], row["first_step"]) for row in rows if row["kind"] == "spike"]


def test_a_spike_threshold_from_the_environment_changes_the_judgement(tmp_path: Path) -> None:
    # +50%, about 65 noise units: above the default z of 14, below 100.
    assert spike_incidents(tmp_path, {}, bad_loss=3.0) == [("spike", 60)]
    assert spike_incidents(tmp_path, {"RUNHEALTH_POLICIES__SPIKE__Z": "100"}, bad_loss=3.0) == []
    # +9%, about 12 noise units: below the default, above 4 and the 5% floor.
    assert spike_incidents(tmp_path, {}, bad_loss=2.18) == []
    assert spike_incidents(tmp_path, {"RUNHEALTH_POLICIES__SPIKE__Z": "4"}, bad_loss=2.18) == [("spike", 60)]


# runhealth config show


def run_show(tmp_path: Path, *args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    """``runhealth config show`` in its own process, with exactly this environment."""
    command = [sys.executable, "-m", "monitor", "config", "show", *args]
    env = {"PATH": os.environ.get("PATH", ""), **environ}
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_show_says_where_each_value_came_from(tmp_path: Path) -> None:
    file = write(tmp_path / "runhealth.toml", "[policies.spike]\nz = 11\nwindow = 60\n")
    shown = run_show(
        tmp_path,
        "--json",
        "--config",
        file,
        RUNHEALTH_POLICIES__SPIKE__Z="12",
        RUNHEALTH_QUARANTINE_LIVE="on",
        RUNHEALTH_ADMIN_TOKEN="rh_admin_secret",
        RUNHEALTH_DB="postgresql+psycopg2://ops:hunter2@db/runhealth",
    )
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    rows = {row["name"]: row for row in document["settings"]}
    assert document["file"] == file
    assert rows["policies.spike.z"] == {
        "name": "policies.spike.z",
        "value": 12.0,
        "source": "environment",
        "origin": "RUNHEALTH_POLICIES__SPIKE__Z",
        "variable": "RUNHEALTH_POLICIES__SPIKE__Z",
    }
    assert (rows["policies.spike.window"]["source"], rows["policies.spike.window"]["origin"]) == (
        "file",
        file,
    )
    assert (rows["policies.spike.warmup"]["source"], rows["policies.spike.warmup"]["value"]) == (
        "default",
        50,
    )
    assert rows["quarantine.live"]["origin"] == "RUNHEALTH_QUARANTINE_LIVE"
    assert rows["policies.stragglers.phases"]["value"] == [
        "data_wait",
        "forward",
        "backward",
        "optimizer",
        "own_wall",
    ]
    assert "rh_admin_secret" not in shown.stdout and "hunter2" not in shown.stdout
    assert len(rows) == len(leaves())


def test_show_prints_a_table_and_a_bad_value_exits_2(tmp_path: Path) -> None:
    shown = run_show(tmp_path, RUNHEALTH_POLICIES__RANK_LOSS__Z="7")
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if "policies.rank_loss.z " in line)
    assert "7.0" in line and "RUNHEALTH_POLICIES__RANK_LOSS__Z" in line
    bad = run_show(tmp_path, RUNHEALTH_POLICIES__SPIKE__Z="high")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "runhealth: error: RUNHEALTH_POLICIES__SPIKE__Z must be a number, got 'high'"


def test_every_watcher_of_the_service_gets_its_configured_section(tmp_path: Path) -> None:
    """Wiring, not judgement: each component holds the section the settings built."""
    environ = {
        "RUNHEALTH_DB": str(tmp_path / "wired.db"),
        "RUNHEALTH_POLICIES__RANK_LOSS__Z": "7",
        "RUNHEALTH_POLICIES__GROUPING__MERGE_GAP": "9",
        "RUNHEALTH_POLICIES__HANGS__STEP_TIME_FACTOR": "4",
        "RUNHEALTH_POLICIES__DEVICES__PEERS__Z": "6",
        "RUNHEALTH_POLICIES__CANARY__QUORUM": "4",
        "RUNHEALTH_POLICIES__RETRIES__PER_INCIDENT": "1",
    }
    service = prepare_store(service_config(environ), environ)
    config = service.config
    assert service.policies._config is config.engine and config.engine.rank_loss.z == 7.0
    assert service.policies.incidents._grouping is config.engine.series.grouping
    assert config.engine.series.grouping.merge_gap == 9
    assert service.hangs._config is config.engine.hangs and config.engine.hangs.step_time_factor == 4.0
    assert service.fleet._config is config.devices and config.devices.peers.z == 6.0
    assert service.canaries._config is config.canaries and config.canaries.comparison.quorum == 4
    assert service.decisions._config is config.decisions and config.decisions.retries.per_incident == 1
    service.engine.dispose()
