"""``nonfinite_response="skip_update"`` (``collectors/skip_update.py``): a real CPU training whose
one window has a NaN loss; its update is skipped on the device, the weights and the optimizer's
state stay as they were and finite, and the record says the window was skipped."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from collectors import RunHealth, RunHealthConfig
from collectors.config import ConfigError, HookConfig
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.transport import TransportConfig
from tests.collectors_support import RecordingTransport
from tests.support import require_module

require_module("torch")
import torch  # noqa: E402

NAN_WINDOW = 5
WINDOWS = 10


def config(tmp_path: Path, response: str) -> RunHealthConfig:
    return RunHealthConfig(
        transport=TransportConfig(run="skip"),
        spool=SpoolConfig(directory=str(tmp_path / "spool")),
        sender=SenderConfig(flush_interval_s=0.02, heartbeat_interval_s=60.0),
        hook=HookConfig(nonfinite_response=response),
    )


def snapshot(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    state = {
        name: {key: value.clone() for key, value in optimizer.state[p].items()}
        for name, p in model.named_parameters()
    }
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "state": state}


def train(
    tmp_path: Path, response: str, *, fused: bool = True, clip: bool = True
) -> tuple[RecordingTransport, list[dict[str, Any]], dict[str, int | None], torch.nn.Module]:
    """Ten windows of a small regression; window 5's loss is NaN. Returns the records, a
    snapshot before and after every window, the hook's counters and the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused or None)
    transport = RecordingTransport()
    snapshots = []
    inputs, targets = torch.randn(32, 8), torch.randn(32, 1)
    hook = RunHealth(
        model=model, optimizer=optimizer, config=config(tmp_path, response), transport=transport, environ={}
    )
    with hook as rh:
        for window in range(1, WINDOWS + 1):
            snapshots.append(snapshot(model, optimizer))
            rh.window_start(sample_ids=[window])
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            if window == NAN_WINDOW:
                loss = loss * float("nan")
            rh.loss(loss, tokens=32)
            loss.backward()
            if clip:
                rh.grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            optimizer.zero_grad()
            rh.window_end()
        snapshots.append(snapshot(model, optimizer))
        progress = rh.progress
    return transport, snapshots, progress, model


def all_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def same(before: dict[str, Any], after: dict[str, Any]) -> bool:
    weights = all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
    state = all(
        torch.equal(before["state"][name][key], after["state"][name][key])
        for name in before["state"]
        for key in before["state"][name]
    )
    return weights and state


@pytest.mark.parametrize("clip", [True, False], ids=["grad-norm-given", "norm-computed-on-device"])
def test_the_nonfinite_windows_update_is_skipped_and_the_weights_stay_finite(
    tmp_path: Path, clip: bool
) -> None:
    transport, snapshots, progress, model = train(tmp_path, "skip_update", clip=clip)
    assert all_finite(model)
    # Window 5 changed nothing: weights, moments and Adam's step counter are as before it.
    assert same(snapshots[NAN_WINDOW - 1], snapshots[NAN_WINDOW])
    # Every other window trained.
    assert not any(same(snapshots[w - 1], snapshots[w]) for w in range(1, WINDOWS + 1) if w != NAN_WINDOW)
    steps = sorted(transport.records("step"), key=lambda r: r["attempt"])
    assert [r["skipped"] for r in steps] == [r["attempt"] == NAN_WINDOW for r in steps]
    assert [r["step"] for r in steps] == [a if a < NAN_WINDOW else a - 1 for a in range(1, WINDOWS + 1)]
    assert progress == {"attempt": WINDOWS, "step": WINDOWS - 1, "consumed": WINDOWS}
    assert steps[NAN_WINDOW - 1]["loss_sum"] == "NaN"  # the record still shows the fault (by name)


def test_without_it_the_nan_reaches_every_weight(tmp_path: Path) -> None:
    transport, _, progress, model = train(tmp_path, "none")
    assert not all_finite(model)
    assert not any(r["skipped"] for r in transport.records("step"))
    assert progress["step"] == WINDOWS


def test_an_optimizer_that_cannot_skip_on_the_device_is_said_once_and_not_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="runhealth.collectors"):
        _, _, _, model = train(tmp_path, "skip_update", fused=False)
    refusals = [r for r in caplog.records if "skip_update needs" in r.getMessage()]
    assert len(refusals) == 1 and "AdamW" in refusals[0].getMessage()
    assert not all_finite(model)  # nothing pretended: the update was not skipped


def test_the_run_start_record_says_what_the_trainer_does_with_a_nonfinite_window(tmp_path: Path) -> None:
    transport, _, _, _ = train(tmp_path, "skip_update")
    (start,) = transport.records("run_start")
    assert start["config"]["runhealth_hook"]["nonfinite_response"] == "skip_update"


def test_an_unknown_response_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="nonfinite_response"):
        HookConfig(nonfinite_response="hold")
    with pytest.raises(ConfigError, match="RUNHEALTH_HOOK__NONFINITE_RESPONSE"):
        RunHealthConfig.from_environ({"RUNHEALTH_HOOK__NONFINITE_RESPONSE": "skip"})
    chosen = RunHealthConfig.from_environ({"RUNHEALTH_HOOK__NONFINITE_RESPONSE": "skip_update"})
    assert chosen.hook.nonfinite_response == "skip_update"


@pytest.mark.slow
def test_four_data_parallel_ranks_skip_the_same_update_and_train_on_finite(tmp_path: Path) -> None:
    """Rank 1's loss is NaN once; the all-reduced gradients carry it to every replica, every
    rank skips that one update (the grad norm decides, the same on all), and the run trains on
    finite. The service records the skip in the nonfinite incident's story and proposes no
    rollback for it."""
    from monitor.store import audit
    from monitor.store.db import create_store_engine, resolve_url
    from tests.collectors_support import ServeProcess, finish_ranks, launch_ranks, step_rows

    serve = ServeProcess(tmp_path, tmp_path / "store.db")
    serve.start()
    try:
        token = serve.create_run("skips")
        command = [
            sys.executable, "-m", "monitor.demo.worker", "--task", "sequence", "--steps", "50",
            "--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path / "results"),
            "--nan", "1:30", "--fused",
        ]  # fmt: skip
        ranks = launch_ranks(
            tmp_path, 4, command,
            RUNHEALTH_URL=serve.url, RUNHEALTH_TOKEN=token, RUNHEALTH_RUN="skips",
            RUNHEALTH_SPOOL_DIR=str(tmp_path / "spool"), RUNHEALTH_HOOK__NONFINITE_RESPONSE="skip_update",
        )  # fmt: skip
        results = finish_ranks(ranks, tmp_path, 240.0)
        assert all(r["progress"]["step"] == 50 for r in results)
        assert {r["progress"]["attempt"] for r in results} == {51}  # one attempt was no update
        rows = step_rows(serve.db, "skips")
        skipped = sorted((row["rank"], row["attempt"], row["step"]) for row in rows if row["skipped"])
        assert skipped == [(rank, 30, 29) for rank in range(4)]
        assert all(math.isfinite(row["loss_sum"]) for row in rows if row["attempt"] > 30)
        engine = create_store_engine(resolve_url(str(serve.db), {}))
        try:
            with engine.connect() as connection:
                incident = connection.execute(
                    sa.text("SELECT id FROM incidents WHERE kind = 'nonfinite'")
                ).scalar_one()
                actions = [e["action"] for e in audit.story(connection, incident)]
                proposed = connection.execute(
                    sa.text("SELECT count(*) FROM proposals WHERE incident_id = :i"), {"i": incident}
                ).scalar_one()
        finally:
            engine.dispose()
        assert "skip_update" in actions, actions
        assert proposed == 0  # the weights never saw the NaN: no rollback to propose
    finally:
        serve.stop()
