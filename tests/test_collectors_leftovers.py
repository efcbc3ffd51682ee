"""``runhealth spool list`` and ``runhealth spool send`` (``collectors/leftovers.py``) against a
real ``runhealth serve``: what a trainer spooled during an outage and left behind reaches the
store once; dead letters are resent only on request; a live trainer's file is left alone; a
service that refuses the sender leaves the spool as it was."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors.counters import Counters
from collectors.sender import Sender, SenderConfig
from collectors.spool import Spool, SpoolConfig
from collectors.transport import HttpTransport, TransportConfig
from tests.collectors_support import ServeProcess, serving, step_rows
from tests.support import cli_result, free_port


def step(attempt: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "step", "incarnation": "inc-1", "rank": 0, "attempt": attempt, "step": attempt,
            "time": 1_700_000_000.0 + attempt, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory.mktemp("serve")) as process:
        yield process


def trainer_left_behind(spool_dir: Path, run: str, attempts: range, name: str = "node-a.rank0.inc1") -> None:
    """A trainer whose service never answered: it ends with its records spooled, and no
    trainer of the run starts again to replay them."""
    transport = HttpTransport(TransportConfig(url=f"http://127.0.0.1:{free_port()}", token="t", run=run))
    counters = Counters()
    spool = Spool(SpoolConfig(directory=str(spool_dir)), run, name, counters)
    config = SenderConfig(close_timeout_s=0.2, retry_initial_s=0.05)
    sender = Sender(config, transport, spool, counters)
    sender.start()
    for attempt in attempts:
        sender.submit(step(attempt))
    assert not sender.close()  # something is left: spooled
    assert counters.snapshot()["spooled"] == len(attempts)


def listed(capsys: pytest.CaptureFixture[str], spool_dir: Path) -> list[dict[str, Any]]:
    code, out, err = cli_result(capsys, "spool", "list", "--dir", str(spool_dir), "--json")
    assert code == 0, err
    files: list[dict[str, Any]] = json.loads(out)["files"]
    return files


def send(
    capsys: pytest.CaptureFixture[str], serve: ServeProcess, token: str, spool_dir: Path, *extra: str
) -> Any:
    code, out, err = cli_result(
        capsys,
        "spool",
        "send",
        "--dir",
        str(spool_dir),
        "--url",
        serve.url,
        "--token",
        token,
        "--json",
        *extra,
    )
    return code, (json.loads(out) if out.strip() else None), err


@pytest.mark.slow
def test_what_a_finished_trainer_left_spooled_is_listed_sent_once_and_gone(
    serve: ServeProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = serve.create_run("left")
    spool_dir = tmp_path / "spool"
    trainer_left_behind(spool_dir, "left", range(1, 26))
    [entry] = listed(capsys, spool_dir)
    assert (entry["run_dir"], entry["kind"], entry["records"], entry["held"]) == ("left", "spool", 25, False)

    code, result, err = send(capsys, serve, token, spool_dir)  # the only run: no --run needed
    assert code == 0, err
    assert (result["replayed"], result["dead_lettered"], result["complete"]) == (25, 0, True)
    assert [row["attempt"] for row in step_rows(serve.db, "left")] == list(range(1, 26))
    assert listed(capsys, spool_dir) == []
    code, out, _ = cli_result(
        capsys, "spool", "send", "--dir", str(spool_dir), "--url", serve.url, "--token", token
    )
    assert code == 0 and "nothing to send" in out


@pytest.mark.slow
def test_a_service_that_refuses_the_sender_leaves_the_spool_as_it_was(
    serve: ServeProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    serve.create_run("refused")
    spool_dir = tmp_path / "spool"
    trainer_left_behind(spool_dir, "refused", range(1, 11))
    before = listed(capsys, spool_dir)
    code, result, err = send(capsys, serve, "not-the-token", spool_dir, "--run", "refused")
    assert code == 1 and result is None and "403" in err and "nothing was sent" in err
    down = ServeProcess(tmp_path, tmp_path / "never.db")  # a port nobody listens on
    code, _, err = send(capsys, down, "t", spool_dir, "--run", "refused")
    assert code == 1 and "ConnectionRefusedError" in err
    assert listed(capsys, spool_dir) == before and before[0]["records"] == 10
    assert step_rows(serve.db, "refused") == []


@pytest.mark.slow
def test_a_live_trainers_file_is_left_to_it(
    serve: ServeProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = serve.create_run("live")
    spool_dir = tmp_path / "spool"
    # A trainer still running (it would adopt files left earlier: it started first here).
    live = Spool(SpoolConfig(directory=str(spool_dir)), "live", "node-b.rank1.inc2", Counters())
    try:
        live.append([step(100), step(101)])  # its own sender will replay these
        trainer_left_behind(spool_dir, "live", range(1, 6), name="node-a.rank0.inc1")
        files = {entry["file"]: entry for entry in listed(capsys, spool_dir)}
        assert files["node-b.rank1.inc2.jsonl"]["held"] and not files["node-a.rank0.inc1.jsonl"]["held"]
        code, result, err = send(capsys, serve, token, spool_dir, "--run", "live")
        assert code == 0, err
        assert result["replayed"] == 5 and result["held"] == ["node-b.rank1.inc2.jsonl"]
        assert [row["attempt"] for row in step_rows(serve.db, "live")] == [1, 2, 3, 4, 5]
        assert [entry["file"] for entry in listed(capsys, spool_dir)] == ["node-b.rank1.inc2.jsonl"]
    finally:
        live.close()


@pytest.mark.slow
def test_dead_letters_are_resent_only_when_asked_and_an_invalid_record_stays_dead(
    serve: ServeProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = serve.create_run("dead")
    spool_dir = tmp_path / "spool"
    counters = Counters()
    spool = Spool(SpoolConfig(directory=str(spool_dir)), "dead", "node-a.rank0.inc1", counters)
    # What a sender writes when the service refused a batch; the cause since fixed (here: the
    # records are valid), and one record that is invalid still.
    spool.dead_letter([step(1), step(2)], "500 internal: a bug since fixed", 500)
    spool.dead_letter([step(3, tokens=-1)], "422 invalid_record: tokens", 422)
    spool.close()
    [entry] = listed(capsys, spool_dir)
    assert (entry["kind"], entry["batches"], entry["records"]) == ("dead", 2, 3)
    assert entry["reasons"] == ["500 internal: a bug since fixed", "422 invalid_record: tokens"]

    code, out, _ = cli_result(
        capsys, "spool", "send", "--dir", str(spool_dir), "--url", serve.url, "--token", token
    )
    assert code == 0 and "nothing to send" in out  # dead letters wait for --dead-letters
    code, result, err = send(capsys, serve, token, spool_dir, "--dead-letters")
    assert code == 0, err
    assert (result["redriven"], result["replayed"], result["dead_lettered"]) == (3, 2, 1)
    assert [row["attempt"] for row in step_rows(serve.db, "dead")] == [1, 2]
    [still_dead] = listed(capsys, spool_dir)  # the invalid record, in the sender's own file
    assert still_dead["kind"] == "dead" and still_dead["records"] == 1
    assert still_dead["file"].startswith("spool-send.") and "422" in still_dead["reasons"][0]


def test_bad_arguments_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli_result(capsys, "spool", "list", "--dir", str(tmp_path / "missing"))
    assert code == 2 and "no spool directory" in err
    (tmp_path / "spool" / "a").mkdir(parents=True)
    (tmp_path / "spool" / "b").mkdir()
    code, _, err = cli_result(capsys, "spool", "send", "--dir", str(tmp_path / "spool"), "--url", "http://x")
    assert code == 2 and "--token" in err
    base = ["spool", "send", "--dir", str(tmp_path / "spool"), "--url", "http://127.0.0.1:1", "--token", "t"]
    code, _, err = cli_result(capsys, *base, "--run", "c")
    assert code == 2 and "no spool for run 'c'" in err
    code, _, err = cli_result(capsys, *base[:4], "--url", "ftp://x", "--token", "t", "--run", "a")
    assert code == 2 and "http(s) URL" in err
    for run in ("a", "b"):
        trainer_left_behind(tmp_path / "spool", run, range(1, 3))
    code, _, err = cli_result(capsys, *base)
    assert code == 2 and "several runs" in err and "a, b" in err


@pytest.mark.slow
def test_a_live_trainers_dead_letters_are_not_resent_under_it(
    serve: ServeProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its sender may append to its dead-letter file at any moment: reading and removing the
    file under it could lose what it appends in between."""
    token = serve.create_run("live-dead")
    spool_dir = tmp_path / "spool"
    live = Spool(SpoolConfig(directory=str(spool_dir)), "live-dead", "node-b.rank1.inc2", Counters())
    try:
        live.dead_letter([step(7)], "500 internal", 500)  # nothing pending in its spool file
        [entry] = listed(capsys, spool_dir)
        assert (entry["kind"], entry["held"]) == ("dead", True)
        code, result, err = send(capsys, serve, token, spool_dir, "--run", "live-dead", "--dead-letters")
        assert code == 0, err
        assert result["redriven"] == 0 and live.dead_letter_path.exists()
        assert step_rows(serve.db, "live-dead") == []
    finally:
        live.close()
