"""What ``rh.resumed`` records (``checkpoint_events.py``, ``restore.py``, ``data_state.py``), and
a real hooked training that resumes the way a nanoGPT-style script does: batches drawn at random
offsets of a token file, the generator re-seeded at every start."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from collectors import RunHealth, RunHealthConfig, build_manifest
from collectors.config import HookConfig
from collectors.data_state import state_digest
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.transport import Delivery, Outcome, TransportConfig
from collectors.wire import Record, encode_batch
from monitor.ingest.schemas import BatchIn
from monitor.service import Service
from monitor.store import models
from tests.collectors_support import RecordingTransport
from tests.support import RunHandle, require_module

require_module("torch")  # before the import: skipped without torch, failed in CI

import torch  # noqa: E402

VOCAB, BLOCK, ROWS = 32, 9, 4
# The token file: fixed, like a tokenized dataset on disk.
TOKENS = torch.randint(0, VOCAB, (4096,), generator=torch.Generator().manual_seed(5))


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens: Any) -> Any:
        return self.head(self.embed(tokens))


def lm_loss(model: TinyLM, tokens: Any) -> Any:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def get_batch() -> tuple[Any, list[int]]:
    """nanoGPT's ``get_batch``: rows at random offsets, drawn from the global generator."""
    offsets = torch.randint(len(TOKENS) - BLOCK, (ROWS,))
    return torch.stack([TOKENS[i : i + BLOCK] for i in offsets]), offsets.tolist()


def config(tmp_path: Path, **hook: Any) -> RunHealthConfig:
    return RunHealthConfig(
        transport=TransportConfig(run="resume-test"),
        spool=SpoolConfig(directory=str(tmp_path / "spool")),
        sender=SenderConfig(flush_interval_s=0.05, heartbeat_interval_s=60.0),
        hook=HookConfig(**hook),
    )


def trained(steps: int) -> tuple[TinyLM, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        lm_loss(model, get_batch()[0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def resume_record(tmp_path: Path, optimizer: Any, **resumed: Any) -> tuple[Record, RunHealth]:
    transport = RecordingTransport()
    rh = RunHealth(config=config(tmp_path), transport=transport, environ={}, hostname=lambda: "n")
    with rh.start():
        rh.watch(optimizer=optimizer)
        rh.resumed(checkpoint_path="ckpt-3", checkpoint_step=3, **resumed)
        tokens, offsets = get_batch()
        rh.window_start(sample_ids=offsets)
        rh.loss(lm_loss(TinyLM(), tokens), labels=tokens)
        rh.window_end()
    (resume,) = transport.records("resume")
    return resume, rh


def test_the_optimizer_says_how_many_parameters_it_holds_and_how_many_have_state(tmp_path: Path) -> None:
    _, optimizer = trained(3)
    resume, _ = resume_record(tmp_path, optimizer, consumed=12)
    assert resume["restored"]["optimizer"]["param_states"] == 3  # embedding, head weight and bias
    assert resume["restored"]["optimizer"]["trainable_params"] == 3
    # Restored weights without the optimizer's state: a fresh AdamW holds the same parameters.
    model, _ = trained(0)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    resume, _ = resume_record(tmp_path / "fresh", fresh, consumed=12)
    optimizer_state = resume["restored"]["optimizer"]
    assert (optimizer_state["param_states"], optimizer_state["trainable_params"]) == (0, 3)
    assert "exp_avg_norm" not in optimizer_state and "optimizer_step_max" not in optimizer_state


def test_plain_sgd_keeps_no_state_so_its_parameters_are_not_counted(tmp_path: Path) -> None:
    """``torch.optim.SGD`` without momentum (its default) stores nothing per parameter: its
    resume says 0 of 0, not 0 of 3 (a lost state); with momentum, a fresh one is 0 of 3."""
    model, _ = trained(0)
    plain = torch.optim.SGD(model.parameters(), lr=1e-3)
    lm_loss(model, get_batch()[0]).backward()
    plain.step()
    resume, _ = resume_record(tmp_path, plain, consumed=12)
    optimizer_state = resume["restored"]["optimizer"]
    assert (optimizer_state["param_states"], optimizer_state["trainable_params"]) == (0, 0)
    momentum = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    resume, _ = resume_record(tmp_path / "momentum", momentum, consumed=12)
    optimizer_state = resume["restored"]["optimizer"]
    assert (optimizer_state["param_states"], optimizer_state["trainable_params"]) == (0, 3)


def test_the_resume_carries_the_rate_its_first_window_trains_with(tmp_path: Path) -> None:
    """A nanoGPT-style loop sets the rate itself at the top of each iteration, after ``resumed``:
    the optimizer's rate at the resume (a fresh optimizer's constructor value) is not the
    schedule's; the first window's is."""
    model, _ = trained(0)
    fresh = torch.optim.AdamW(model.parameters(), lr=6e-4)  # nanoGPT: the peak rate
    transport = RecordingTransport()
    rh = RunHealth(config=config(tmp_path), transport=transport, environ={}, hostname=lambda: "n")
    with rh.start():
        rh.watch(optimizer=fresh)
        rh.resumed(checkpoint_path="ckpt-3", checkpoint_step=3, consumed=12)
        for group in fresh.param_groups:
            group["lr"] = 2.5e-4  # get_lr(iter_num): where the schedule is at step 3
        tokens, offsets = get_batch()
        rh.window_start(sample_ids=offsets)
        rh.loss(lm_loss(model, tokens), labels=tokens)
        rh.window_end()
    (resume,) = transport.records("resume")
    assert resume["restored"]["optimizer"]["lr"] == [6e-4]
    assert resume["restored"]["first_window_lr"] == 2.5e-4


def test_the_data_position_says_what_can_be_checked(tmp_path: Path) -> None:
    _, optimizer = trained(3)
    sampler_state = {"seed": 1337, "offset": 12, "rng": torch.get_rng_state()}
    resume, _ = resume_record(tmp_path, optimizer, consumed=12, data_state=sampler_state)
    assert resume["restored"]["data"] == {"deterministic": False, "state_digest": state_digest(sampler_state)}
    resume, _ = resume_record(tmp_path / "declared", optimizer, consumed=12, deterministic_data=True)
    assert resume["restored"]["data"] == {"deterministic": True}
    # A state that cannot be digested is named; the resume is still recorded.
    resume, rh = resume_record(tmp_path / "odd", optimizer, consumed=12, data_state={"it": object()})
    assert "cannot digest a object" in resume["restored"]["data"]["state_error"]
    assert rh.counters.get("hook_errors", 0) == 0


def test_the_config_declares_a_deterministic_order_for_every_resume(tmp_path: Path) -> None:
    _, optimizer = trained(3)
    transport = RecordingTransport()
    rh = RunHealth(
        config=config(tmp_path, deterministic_data=True),
        transport=transport,
        environ={},
        hostname=lambda: "n",
    )
    with rh.start():
        rh.watch(optimizer=optimizer)
        rh.resumed(checkpoint_step=3, consumed=12, first_sample_ids=[1, 2])
    assert transport.records("resume")[0]["restored"]["data"]["deterministic"] is True


def test_a_resume_without_a_cursor_leaves_the_consumed_count_unknown(tmp_path: Path) -> None:
    _, optimizer = trained(3)
    resume, rh = resume_record(tmp_path, optimizer)
    assert resume["restored"]["consumed"] is None
    assert rh.progress == {"attempt": 1, "step": 3, "consumed": None}  # not 4: nothing says 0 came before


@pytest.mark.parametrize(
    ("run", "environ", "told"),
    [
        (None, {}, True),  # a hand-launched script: each start is named from its time
        ("named", {}, False),
        (None, {"SLURM_JOB_ID": "77"}, False),  # a requeue keeps the job id, and with it the run
    ],
)
def test_a_resume_in_a_run_named_from_its_start_time_says_it_is_not_the_saving_run(
    tmp_path: Path, run: str | None, environ: dict[str, str], told: bool, caplog: pytest.LogCaptureFixture
) -> None:
    _, optimizer = trained(1)
    settings = replace(config(tmp_path), transport=TransportConfig(run=run))
    rh = RunHealth(config=settings, transport=RecordingTransport(), environ=environ, hostname=lambda: "n")
    with caplog.at_level(logging.WARNING, logger="runhealth.collectors"), rh.start():
        rh.watch(optimizer=optimizer)
        rh.resumed(checkpoint_path="out/ckpt.pt", checkpoint_step=1)
        rh.resumed(checkpoint_path="out/ckpt.pt", checkpoint_step=1)  # said once
    said = [r.getMessage() for r in caplog.records if "a name taken from this start's time" in r.getMessage()]
    assert len(said) == (1 if told else 0)
    if told:
        assert f"in run {rh.run}," in said[0] and "RUNHEALTH_RUN=NAME" in said[0]
        assert said[0].startswith("runhealth: resuming from out/ckpt.pt in run ")


def test_the_digest_is_of_the_content() -> None:
    state = {"offsets": torch.arange(6), "epoch": 2, "names": ("a", "b"), "blob": b"\x00\x01"}
    again = {"blob": b"\x00\x01", "names": ("a", "b"), "epoch": 2, "offsets": torch.arange(6)}
    assert state_digest(state) == state_digest(again)  # key order is not content
    assert state_digest(state) != state_digest({**state, "offsets": torch.arange(6) + 1})
    assert state_digest({"x": torch.ones(2, dtype=torch.bfloat16)}) != state_digest({"x": torch.ones(2)})
    assert state_digest(1) != state_digest(1.0) != state_digest("1")


# A real training against the service in this process.


class ServiceTransport:
    """Batches into a ``Service`` in this process, validated as the ingest API validates them."""

    def __init__(self, service: Service, run: RunHandle) -> None:
        self._service = service
        self._run = run

    def post(self, records: Sequence[Record]) -> Delivery:
        batch = BatchIn.model_validate_json(encode_batch(records))
        self._service.ingest(self._run.name, self._run.id, batch.records)
        return Delivery(Outcome.DELIVERED, 200)

    def close(self) -> None:
        return None


def nanogpt_style(
    root: Path, transport: ServiceTransport, first: int, last: int, resume_from: Path | None, **resumed: Any
) -> None:
    """One start of the script: re-seed, build, optionally resume from the one checkpoint
    file, train ``first..last`` drawing each batch at random, checkpoint at iteration 20."""
    torch.manual_seed(1337)  # the script seeds at every start, so a resumed run re-draws
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rh = RunHealth(
        model=model,
        optimizer=optimizer,
        config=config(root),
        transport=transport,
        environ={},
        hostname=lambda: "node-a",
    )
    with rh.start():
        if resume_from is not None:
            saved = torch.load(resume_from / "ckpt.pt")
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            rh.resumed(
                checkpoint_path=str(resume_from),
                checkpoint_step=saved["iter_num"],
                consumed=saved["iter_num"] * ROWS,
                **resumed,
            )
        for iter_num in range(first, last):
            tokens, offsets = get_batch()
            rh.window_start(sample_ids=offsets)
            loss = lm_loss(model, tokens)
            rh.loss(loss, labels=tokens)
            loss.backward()
            rh.grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            optimizer.zero_grad()
            rh.window_end()
            if iter_num + 1 == 20 and resume_from is None:
                folder = root / "out"
                folder.mkdir()
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": 20},
                    folder / "ckpt.pt",
                )
                rh.checkpoint_saved(20, str(folder), manifest=build_manifest(folder, 20, 20 * ROWS))


def findings(service: Service, run: RunHandle) -> list[dict[str, Any]]:
    table = models.table_of(models.FindingRow)
    with service.engine.connect() as connection:
        rows = connection.execute(sa.select(table).where(table.c.run_id == run.id).order_by(table.c.id))
        return [dict(row) for row in rows.mappings()]


def counts(service: Service, run: RunHandle, model: type[Any]) -> int:
    table = models.table_of(model)
    with service.engine.connect() as connection:
        query = sa.select(sa.func.count()).select_from(table).where(table.c.run_id == run.id)
        return int(connection.execute(query).scalar_one())


def random_draws_run(service: Service, run: RunHandle, tmp_path: Path, **resumed: Any) -> None:
    transport = ServiceTransport(service, run)
    nanogpt_style(tmp_path / "first", transport, 0, 30, None)
    nanogpt_style(tmp_path / "second", transport, 20, 30, tmp_path / "first" / "out", **resumed)


def test_a_trainer_that_draws_at_random_gets_one_note_and_no_incident(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    random_draws_run(service, run, tmp_path)
    found = findings(service, run)
    assert [(f["kind"], f["severity"]) for f in found] == [("data_order_not_reproducible", "info")]
    (note,) = found
    assert (
        note["message"] == "data order is not reproducible: continuity of the data position cannot be checked"
    )
    assert (note["step"], note["incident_id"], note["evidence"]["cursor_checked"]) == (21, None, True)
    assert counts(service, run, models.Incident) == 0
    assert counts(service, run, models.Proposal) == 0
    assert counts(service, run, models.ResumeEvent) == 1


def test_the_same_trainer_declared_deterministic_is_told_its_batches_differ(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    # The check is live: claiming a reproducible order the script does not have is caught.
    random_draws_run(service, run, tmp_path, deterministic_data=True)
    kinds = [(f["kind"], f["signal"], f["severity"]) for f in findings(service, run)]
    assert kinds == [("data_cursor_mismatch", "sample_ids", "critical")]
