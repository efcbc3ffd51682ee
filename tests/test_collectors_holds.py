"""Holding on the hook's side (``collectors/holds.py``): what ends a hold, and a hooked training
in one process that pauses between two windows until its release comes, the pause reported as
the ``held`` phase and never as a window's data wait. The four-rank agreement is in
``tests/test_recovery_holds.py``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from collectors import RunHealth, RunHealthConfig
from collectors.config import HookConfig
from collectors.directives import Armory, Consensus, Directive, DirectiveConfig
from collectors.holds import TIMED_OUT, hold_until_released
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.transport import TransportConfig
from tests.collectors_support import RecordingTransport, wait_until
from tests.support import require_module

CONFIG = DirectiveConfig(hold_agree_s=0.01, hold_grace_s=5.0)
HOLD = Directive(5, "hold", 10, {"proposal": 1, "timeout_s": 30.0})


class FakeClock:
    """Monotonic time that moves only when the hold sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.on_sleep: list[Any] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for act in self.on_sleep:
            act(self.now)


def solo() -> Consensus:
    return Consensus(None, None, 1)


def armed(*directives: Directive) -> Armory:
    armory = Armory()
    armory.update(list(directives), step=12, answer=lambda *_: None)
    return armory


def hold(armory: Armory, clock: FakeClock, meanwhile: list[Directive] | None = None) -> Any:
    seen = meanwhile if meanwhile is not None else []
    return hold_until_released(HOLD, armory, solo(), CONFIG, seen.append, clock.monotonic, clock.sleep)


def test_a_release_ends_the_hold() -> None:
    clock = FakeClock()
    armory = armed()
    release = Directive(6, "release", 10, {"hold": 5})
    clock.on_sleep.append(lambda now: armory.update([release], 12, lambda *_: None) if now > 1 else None)
    released = hold(armory, clock)
    assert (released.by, released.directive) == ("release", release)
    assert 1.0 < released.held_s < 1.1


def test_a_rollback_ends_the_hold_and_a_canary_runs_meanwhile() -> None:
    clock = FakeClock()
    canary = Directive(6, "canary", 13, {})  # ahead of the held step: run during the hold
    rollback = Directive(7, "rollback", 90, {"checkpoint_step": 0})  # its step is ahead: no matter
    armory = armed(canary)
    clock.on_sleep.append(
        lambda now: armory.update([canary, rollback], 12, lambda *_: None) if now > 0.5 else None
    )
    meanwhile: list[Directive] = []
    released = hold(armory, clock, meanwhile)
    assert (released.by, released.directive) == ("rollback", rollback)
    assert meanwhile == [canary]


def test_an_older_holds_late_release_does_not_release_this_one() -> None:
    clock = FakeClock()
    stale = Directive(4, "release", 3, {"hold": 2})
    armory = armed(stale)
    meanwhile: list[Directive] = []
    released = hold(armory, clock, meanwhile)
    assert meanwhile == [stale] and released.by == "timeout"


def test_without_a_release_the_ranks_go_on_past_the_timeout_and_its_grace() -> None:
    clock = FakeClock()
    released = hold(armed(), clock)
    assert released.by == "timeout" and released.directive is None
    assert 35.0 <= clock.now < 35.1  # timeout_s 30 + hold_grace_s 5


def test_the_timeout_is_agreed_only_when_every_rank_contributes_it() -> None:
    assert TIMED_OUT > 2**53  # no directive id comes near


def test_hold_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="hold_agree_s"):
        DirectiveConfig(hold_agree_s=0)
    with pytest.raises(ValueError, match="hold_grace_s"):
        DirectiveConfig(hold_grace_s=-1)


# A hooked training in one process.

require_module("torch")
import torch  # noqa: E402


class HoldingTransport(RecordingTransport):
    """Records in-process; the directive poll answers whatever ``pending`` holds now."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[dict[str, Any]] = []

    def directives(self, incarnation: str, rank: int) -> list[dict[str, Any]]:
        return list(self.pending)

    def acks(self, directive_id: int) -> list[dict[str, Any]]:
        return [a for a in self.records("directive_ack") if a["directive_id"] == directive_id]


def test_a_hooked_training_pauses_between_windows_until_released(tmp_path: Path) -> None:
    transport = HoldingTransport()
    config = RunHealthConfig(
        transport=TransportConfig(run="held"),
        spool=SpoolConfig(directory=str(tmp_path / "spool")),
        sender=SenderConfig(flush_interval_s=0.02, heartbeat_interval_s=0.05),
        hook=HookConfig(agree_every=1),
        directives=DirectiveConfig(poll_interval_s=0.02, hold_agree_s=0.01),
    )
    hold_wire = {"id": 5, "kind": "hold", "act_at_step": 3, "payload": {"proposal": 1, "timeout_s": 60.0}}
    release_wire = {
        "id": 6,
        "kind": "release",
        "act_at_step": 3,
        "payload": {"hold": 5, "reason": "rejected"},
    }
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held_phase: list[str] = []

    def release_once_held() -> None:
        assert wait_until(lambda: transport.acks(5), 20)
        assert wait_until(lambda: any(b["phase"] == "held" for b in transport.records("heartbeat")), 20)
        held_phase.append("held")
        transport.pending = [hold_wire, release_wire]

    releaser = threading.Thread(target=release_once_held)
    with RunHealth(model=model, optimizer=optimizer, config=config, transport=transport, environ={}) as rh:
        for attempt in range(400):
            if attempt == 5:
                transport.pending = [hold_wire]
                releaser.start()
            rh.window_start(sample_ids=[attempt])
            loss = model(torch.ones(2, 4)).pow(2).mean()
            rh.loss(loss, tokens=2)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rh.window_end()
            if transport.acks(6):
                break
        releaser.join()
    assert held_phase == ["held"]
    (held,) = transport.acks(5)
    (released,) = transport.acks(6)
    assert held["status"] == released["status"] == "done"
    assert held["detail"]["held_at_step"] == released["detail"]["held_at_step"] == released["step"]
    assert released["detail"]["released_by"] == "release" and released["detail"]["held_s"] > 0
    steps = transport.records("step")
    after = [s for s in steps if s["step"] == held["step"] + 1]
    assert after and (after[0]["data_wait_s"] or 0.0) < 1.0  # the pause is not data wait
