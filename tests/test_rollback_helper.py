"""``handle_rollback`` (collectors/rollback.py) on a real hook and a real CPU training, the
rollback directive handed over in-process as the service would (``RecordingTransport``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from collectors import HookConfig, Rollback, RunHealth, RunHealthConfig, handle_rollback, load_state_dicts
from collectors.directives import DirectiveConfig
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.transport import TransportConfig
from tests.collectors_support import RecordingTransport, wait_until
from tests.support import require_module

torch = require_module("torch")


class RollbackTransport(RecordingTransport):
    """Records in-process; every directive poll answers one rollback to ``path`` at step 3."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.polls = 0
        self.directive = {
            "id": 11,
            "kind": "rollback",
            "act_at_step": 3,
            "payload": {
                "proposal": 5,
                "checkpoint_path": str(path),
                "checkpoint_step": 2,
                "skip_batches": ["3", "b-7"],
                "avoid_devices": [],
                "avoid_nodes": ["node-9"],
            },
        }

    def directives(self, incarnation: str, rank: int) -> list[dict[str, Any]]:
        self.polls += 1
        return [self.directive]


def hook(transport: RecordingTransport, root: Path, model: Any, optimizer: Any) -> RunHealth:
    """Directives polled every 50 ms and agreed at every window boundary."""
    config = RunHealthConfig(
        transport=TransportConfig(run="rollback-helper"),
        spool=SpoolConfig(directory=str(root / "spool")),
        sender=SenderConfig(flush_interval_s=0.05, heartbeat_interval_s=60.0),
        hook=HookConfig(agree_every=1),
        directives=DirectiveConfig(poll_interval_s=0.05),
    )
    return RunHealth(
        model=model, optimizer=optimizer, config=config, transport=transport, environ={}, hostname=lambda: "n"
    )


class Trainer:
    """A tiny language model trained window by window, the way a hand-written loop does it."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.tokens = torch.randint(0, 16, (4, 9))

    def window(self, rh: RunHealth, ids: list[int], *, close: bool = True) -> None:
        rh.window_start(sample_ids=ids)
        logits = self.model(self.tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten())
        rh.loss(loss, labels=self.tokens[:, 1:])
        loss.backward()  # type: ignore[no-untyped-call]
        rh.grad_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.optimizer.step()
        self.optimizer.zero_grad()
        if close:
            rh.window_end()

    def save(self, path: Path, step: int) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}
        torch.save(state, path)

    def load(self, path: str) -> int:
        state = torch.load(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return int(state["step"])


def train_until_rollback(
    rh: RunHealth,
    trainer: Trainer,
    transport: RollbackTransport,
    path: Path,
    restore: Any = None,
    **options: Any,
) -> tuple[Rollback[Any], list[str]]:
    """Windows until the helper carries out the rollback (the directive is armed by the sender
    thread, so the loop waits for its first polls before the step it names). ``restore``: the
    load function (the trainer's own by default)."""
    loaded: list[str] = []

    def load(where: str) -> Any:
        loaded.append(where)
        return (restore or trainer.load)(where)

    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        rollback = handle_rollback(rh, load, **options)
        if rollback is not None:
            return rollback, loaded
        step = int(rh.progress["step"] or 0)
        trainer.window(rh, [step * 10, step * 10 + 1])
        if step + 1 == 2:
            trainer.save(path, 2)
            assert wait_until(lambda: transport.polls >= 2, 10)  # armed before step 3
    raise AssertionError("no rollback carried out")


def test_a_rollback_is_restored_by_the_trainers_load_and_resumed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    transport = RollbackTransport(path)
    trainer = Trainer()
    with hook(transport, tmp_path, trainer.model, trainer.optimizer) as rh:
        rollback, loaded = train_until_rollback(rh, trainer, transport, path)
        assert wait_until(lambda: transport.records("step"), 10)  # sent by the sender thread
        stopped_incarnation = transport.records("step")[-1]["incarnation"]
        assert loaded == [str(path)]  # the trainer's own load, once, with the directive's path
        assert rollback.loaded == 2 and rollback.checkpoint_step == 2
        assert (rollback.directive, rollback.checkpoint_path) == (11, str(path))
        assert rollback.skip == frozenset({"3", "b-7"}) and rollback.avoid_nodes == ("node-9",)
        assert not rh.should_stop() and rh.directive is None  # resumed: the stop is over
        assert rh.progress["step"] == 2  # counting on from the checkpoint
        assert handle_rollback(rh, trainer.load) is None  # the same directive is not run twice
        trainer.window(rh, [20, 21])
    resume = transport.records("resume")
    assert len(resume) == 1
    assert resume[0]["checkpoint_path"] == str(path) and resume[0]["checkpoint_step"] == 2
    steps = transport.records("step")
    after = [s for s in steps if s["incarnation"] != stopped_incarnation]
    assert [s["step"] for s in after] == [3] and resume[0]["incarnation"] == after[0]["incarnation"]
    acks = transport.records("directive_ack")
    assert [(a["directive_id"], a["status"]) for a in acks] == [(11, "done")]


def test_no_directive_no_rollback_and_load_is_not_called(tmp_path: Path) -> None:
    transport = RecordingTransport()
    trainer = Trainer()

    def load(path: str) -> None:
        raise AssertionError("load called without a rollback")

    with hook(transport, tmp_path, trainer.model, trainer.optimizer) as rh:
        assert handle_rollback(rh, load) is None  # before the first window: nothing attached yet
        for index in range(3):
            trainer.window(rh, [index])
            assert handle_rollback(rh, load) is None
    assert len(transport.records("step")) == 3 and transport.records("resume") == []


def test_a_window_left_open_is_closed_before_the_stop(tmp_path: Path) -> None:
    """A loop that never calls ``window_end`` (the next ``window_start`` would close it): the
    helper closes it, so its update counts before the stop and its record stays in the
    incarnation that trained it."""
    path = tmp_path / "ckpt.pt"
    transport = RollbackTransport(path)
    trainer = Trainer()
    with hook(transport, tmp_path, trainer.model, trainer.optimizer) as rh:
        deadline = time.monotonic() + 20.0
        rollback = None
        while rollback is None and time.monotonic() < deadline:
            rollback = handle_rollback(rh, trainer.load)
            if rollback is None:
                trainer.window(rh, [int(rh.progress["attempt"] or 0)], close=False)
                if rh.progress["step"] == 1:  # window 2 is open: save what it will have made
                    trainer.save(path, 2)
                    assert wait_until(lambda: transport.polls >= 2, 10)
        assert rollback is not None and rollback.checkpoint_step == 2
    steps = transport.records("step")
    first = steps[0]["incarnation"]
    before = [s for s in steps if s["incarnation"] == first]
    assert [s["step"] for s in before] == list(range(1, len(before) + 1)) and len(before) >= 3


def test_resume_passes_what_the_trainers_checkpoint_recorded(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    transport = RollbackTransport(path)
    trainer = Trainer()
    with hook(transport, tmp_path, trainer.model, trainer.optimizer) as rh:
        rollback, _ = train_until_rollback(
            rh, trainer, transport, path, resume=lambda step: {"consumed": step * 8}
        )
        assert rollback.loaded == 2
        trainer.window(rh, [30, 31])
    (resume,) = transport.records("resume")
    assert resume["restored"]["consumed"] == 16
    assert transport.records("step")[-1]["consumed"] == 16 + 2


def test_without_resume_the_consumed_count_comes_from_the_directive(tmp_path: Path) -> None:
    """The service puts the checkpoint's consumed count in the directive; a ``resume`` that
    names one wins over it."""
    path = tmp_path / "ckpt.pt"
    transport = RollbackTransport(path)
    transport.directive["payload"]["checkpoint_consumed"] = 4
    trainer = Trainer()
    with hook(transport, tmp_path, trainer.model, trainer.optimizer) as rh:
        train_until_rollback(rh, trainer, transport, path)
        trainer.window(rh, [30, 31])
    (resume,) = transport.records("resume")
    assert resume["restored"]["consumed"] == 4
    assert transport.records("step")[-1]["consumed"] == 4 + 2
    transport = RollbackTransport(path)
    transport.directive["payload"]["checkpoint_consumed"] = 4
    with hook(transport, tmp_path / "given", trainer.model, trainer.optimizer) as rh:
        train_until_rollback(rh, trainer, transport, path, resume=lambda step: {"consumed": 99})
    assert transport.records("resume")[0]["restored"]["consumed"] == 99


def test_a_checkpoint_saved_without_consumed_records_the_hooks_own_count(tmp_path: Path) -> None:
    """``checkpoint_saved(step, path)`` takes the hook's consumed count at the call (two
    examples a window here), in the record and in its manifest; the count the directive then
    carries back restores it."""
    path = tmp_path / "ckpt.pt"
    transport = RecordingTransport()
    trainer = Trainer()
    with hook(transport, tmp_path, trainer.model, trainer.optimizer) as rh:
        for step in range(3):
            trainer.window(rh, [step * 10, step * 10 + 1])
        trainer.save(path, 3)
        rh.checkpoint_saved(3, path)
        trainer.window(rh, [30, 31])
        rh.checkpoint_saved(4, tmp_path / "explicit.pt", consumed=7, hash_files=False)
        given = {"step": 5, "consumed": 9, "files": [{"path": ".", "size": 1, "sha256": "0" * 64}]}
        rh.checkpoint_saved(5, tmp_path / "given.pt", manifest=given)
    first, second, third = sorted(transport.records("checkpoint"), key=lambda record: record["step"])
    assert (first["step"], first["consumed"], first["manifest"]["consumed"]) == (3, 6, 6)
    assert (second["step"], second["consumed"]) == (4, 7)  # a count the trainer gives wins
    assert (third["step"], third["consumed"]) == (5, 9)  # and so does the manifest's


def test_a_load_that_fails_raises_and_the_rank_stays_stopped(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    transport = RollbackTransport(path)
    trainer = Trainer()

    def broken(where: str) -> int:
        raise FileNotFoundError(where)

    with hook(transport, tmp_path, trainer.model, trainer.optimizer) as rh:
        deadline = time.monotonic() + 20.0
        with pytest.raises(FileNotFoundError):
            while time.monotonic() < deadline:
                handle_rollback(rh, broken)
                step = int(rh.progress["step"] or 0)
                trainer.window(rh, [step])
                if step + 1 == 2:
                    assert wait_until(lambda: transport.polls >= 2, 10)
        assert rh.should_stop() and rh.directive is not None and rh.directive["id"] == 11
    assert transport.records("resume") == []


def test_the_skip_list_filters_batches_by_their_ids() -> None:
    rollback = Rollback(
        directive=1,
        checkpoint_path="/c",
        checkpoint_step=0,
        skip=frozenset({"3", "b-7"}),
        avoid_nodes=(),
        avoid_devices=(),
        loaded=None,
    )
    assert not rollback.keeps(3) and not rollback.keeps("b-7") and rollback.keeps(4)
    assert not rollback.keeps([1, 3]) and rollback.keeps((1, 2))
    assert not rollback.keeps(torch.tensor([5, 3])) and rollback.keeps(torch.tensor(4))
    batches = [{"ids": [1]}, {"ids": [3]}, {"ids": ["b-7", 8]}, {"ids": [9]}]
    assert list(rollback.skipping(batches, lambda b: b["ids"])) == [{"ids": [1]}, {"ids": [9]}]


def test_a_checkpoint_of_state_dicts_needs_no_load_function_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    transport = RollbackTransport(path)
    trainer = Trainer()
    restore = load_state_dicts(model=trainer.model, optimizer=trainer.optimizer)
    with hook(transport, tmp_path, trainer.model, trainer.optimizer) as rh:
        rollback, _ = train_until_rollback(rh, trainer, transport, path, restore)
        saved = torch.load(path)
        assert rollback.loaded["step"] == 2  # the whole checkpoint dict comes back
        for name, value in trainer.model.state_dict().items():
            assert torch.equal(value, saved["model"][name])  # the weights of step 2, restored
        assert trainer.optimizer.state_dict()["state"][0]["step"] == saved["optimizer"]["state"][0]["step"]
    torch.save({"model": trainer.model.state_dict()}, tmp_path / "weights-only.pt")
    with pytest.raises(KeyError, match="holds no optimizer"):
        restore(str(tmp_path / "weights-only.pt"))
