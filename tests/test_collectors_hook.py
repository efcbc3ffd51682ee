"""The per-rank hook in one process: what a window records, the three counters, the ring,
phases, heartbeats, checkpoint and resume events, and that nothing raises into training."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

import numpy
import pytest

from collectors import (
    RecordSink,
    RunHealth,
    RunHealthConfig,
    build_manifest,
    dump_stacks,
    supervised_tokens,
)
from collectors import checkpoints as checkpoints_module
from collectors.attach import Destination
from collectors.config import ConfigError, HookConfig
from collectors.layout import Coordinate, layout_from_groups, layout_from_mesh
from collectors.markers import WallMarker
from collectors.phases import (
    CpuStamps,
    CudaStamps,
    Phase,
    PhaseClock,
    WallStamps,
    durations,
    stamps_for,
    wall_durations,
)
from collectors.rendezvous import Rendezvous
from collectors.ring import PinnedRing, RingConfig
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.transport import Delivery, TransportConfig
from collectors.window import Counting
from collectors.wire import Record
from policies.checkpoints import manifest_digest
from tests.adapters_support import ROLLBACK, directed_hook
from tests.collectors_support import REPO, FakeMarker, RecordingTransport, child_environ, wait_until
from tests.support import free_port, require_module

require_module("torch")  # before the import: skipped without torch, failed in CI

import torch  # noqa: E402

VOCAB = 32


def hook_config(tmp_path: Path, **sender: Any) -> RunHealthConfig:
    return RunHealthConfig(
        transport=TransportConfig(run="hook-test"),
        spool=SpoolConfig(directory=str(tmp_path / "spool")),
        sender=SenderConfig(**{"flush_interval_s": 0.05, "heartbeat_interval_s": 60.0, **sender}),
    )


@pytest.fixture
def transport() -> RecordingTransport:
    return RecordingTransport()


def attach(tmp_path: Path, transport: RecordingTransport, **kwargs: Any) -> RunHealth:
    config = kwargs.pop("config", None) or hook_config(tmp_path)
    hook = RunHealth(config=config, transport=transport, environ={}, hostname=lambda: "node-a", **kwargs)
    return hook.start()


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens: Any) -> Any:
        return self.head(self.embed(tokens))


def lm_loss(model: TinyLM, batch: Any) -> Any:
    """Hugging Face style: labels are the inputs, the loss shifts them."""
    logits = model(batch)[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def batches(count: int, rows: int = 4, length: int = 9, seed: int = 0) -> Iterator[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    for index in range(count):
        tokens = torch.randint(0, VOCAB, (rows, length), generator=generator)
        yield {"tokens": tokens, "ids": list(range(index * rows, (index + 1) * rows))}


# Token counting.


def test_supervised_tokens_drop_the_shifted_first_label_and_the_ignore_index() -> None:
    labels = torch.tensor([[5, 6, -100, 7], [-100, -100, 1, 2]])
    # shifted: [6, -100, 7] and [-100, 1, 2]: 2 + 2 supervised tokens
    assert float(supervised_tokens(labels)) == 4
    assert float(supervised_tokens(labels, shift=False)) == 5
    assert float(supervised_tokens(labels, shift=False, ignore_index=7)) == 7


def test_one_dimensional_labels_are_one_class_per_example_and_never_shifted() -> None:
    """A classifier's ``y`` (32 examples): 32 targets, not 31, and a batch of one is one, not none;
    on the device, on the host, and stacked over windows alike."""
    y = torch.tensor([3, -100, 1, 0])
    assert float(supervised_tokens(y)) == 3 and float(supervised_tokens(torch.tensor([7]))) == 1
    counting = Counting(shift=True, ignore_index=-100)
    assert counting.count(y) == 3 and counting.count(torch.tensor([7])) == 1
    stacked = numpy.stack([y.numpy(), y.numpy()])
    assert numpy.count_nonzero(counting.supervised(stacked, 1), axis=1).tolist() == [3, 3]
    assert counting.count(torch.tensor([[5, 6, -100, 7]])) == 2  # a sequence is still shifted


def test_supervised_tokens_stay_on_the_device_as_exact_float64() -> None:
    count = supervised_tokens(torch.ones(2, 3, dtype=torch.long))
    assert isinstance(count, torch.Tensor) and count.dim() == 0
    assert count.dtype == torch.float64 and count.device.type == "cpu"


# What a window records.


def test_a_sample_id_wider_than_64_bits_travels_as_its_decimal_string(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """A 128-bit id (a content hash) failed the window's encoding, and the window was lost."""
    wide = 2**100 + 7
    with attach(tmp_path, transport) as rh:
        for window in range(3):
            rh.window_start(sample_ids=[wide, window, -(2**63)])
            rh.loss(1.0, tokens=4)
            rh.window_end()
    steps = transport.records("step")
    assert [s["sample_ids"] for s in steps] == [[str(wide), w, -(2**63)] for w in range(3)]
    assert rh.counters["hook_errors"] == 0


def test_a_plain_loop_records_each_window(tmp_path: Path, transport: RecordingTransport) -> None:
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norms, losses = [], []
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        for batch in rh.windows(batches(3), sample_ids=lambda b: b["ids"]):
            loss = lm_loss(model, batch["tokens"])
            rh.loss(loss, labels=batch["tokens"])
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            rh.grad_norm(norm)
            optimizer.step()
            optimizer.zero_grad()
            norms.append(float(norm))
            losses.append(float(loss.detach()))
    steps = transport.records("step")
    assert [s["attempt"] for s in steps] == [1, 2, 3]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["consumed"] for s in steps] == [4, 8, 12]
    first = steps[0]
    assert first["tokens"] == 4 * 8
    assert first["loss_sum"] == pytest.approx(losses[0] * 32, rel=1e-6)
    assert first["reported_loss"] == pytest.approx(losses[0], rel=1e-6)
    assert [s["grad_norm"] for s in steps] == pytest.approx(norms)  # before clipping to 0.01
    assert first["lr"] == 0.1 and first["skipped"] is False
    assert first["sample_ids"] == [0, 1, 2, 3] and steps[2]["sample_ids"] == [8, 9, 10, 11]
    assert first["node"] == "node-a" and first["rank"] == 0 and first["dp_rank"] == 0
    assert "device_uuid" not in first  # CPU
    for name in ("data_wait_s", "forward_s", "backward_s", "optimizer_s"):
        assert first[name] >= 0
    assert first["microbatches"] == 1


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_skipped_amp_step_is_an_attempt_and_consumed_data_but_not_an_update(
    tmp_path: Path, transport: RecordingTransport, fused: bool
) -> None:
    """A GradScaler that finds an inf skips ``optimizer.step``; a fused optimizer is stepped
    anyway and skips inside its kernel, which the hook learns from the scaler's flag."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with attach(tmp_path, transport, model=model, optimizer=optimizer, scaler=scaler) as rh:
        for index, batch in enumerate(rh.windows(batches(5), sample_ids=lambda b: b["ids"])):
            loss = lm_loss(model, batch["tokens"])
            rh.loss(loss, labels=batch["tokens"])
            scaler.scale(loss).backward()
            if index == 2:  # an overflow: the scaler will skip optimizer.step entirely
                grad = model.head.weight.grad
                assert grad is not None
                grad.fill_(math.inf)
            scaler.unscale_(optimizer)
            rh.grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    steps = transport.records("step")
    assert [s["attempt"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s["step"] for s in steps] == [1, 2, 2, 3, 4]
    assert [s["skipped"] for s in steps] == [False, False, True, False, False]
    assert [s["consumed"] for s in steps] == [4, 8, 12, 16, 20]
    assert steps[2]["grad_norm"] == "Infinity"
    # The scale this window used; the backoff shows from the next window on.
    assert [s["loss_scale"] for s in steps] == [65536.0, 65536.0, 65536.0, 32768.0, 32768.0]
    assert rh.progress == {"attempt": 5, "step": 4, "consumed": 20}


class MegatronOptimizer:
    """Megatron-LM's mixed-precision optimizer as the hook reads it: ``get_loss_scale()`` returns
    its grad scaler's scale tensor, replaced by a backoff."""

    def __init__(self) -> None:
        self.scale = torch.tensor(65536.0)

    def get_loss_scale(self) -> torch.Tensor:
        return self.scale


class DeepSpeedOptimizer:
    """DeepSpeed's ZeRO optimizer as the hook reads it: a ``loss_scale`` property, a number."""

    def __init__(self) -> None:
        self.cur = 4096.0

    @property
    def loss_scale(self) -> float:
        return self.cur


@pytest.mark.parametrize("kind", ["megatron", "deepspeed", "function", "device"])
def test_a_loss_scale_is_read_from_each_kind_of_scaler(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Megatron-LM's and DeepSpeed's optimizers carry their own loss scale, not a GradScaler;
    a function may also say it. Each window records the scale it started with (a backoff
    after the first window halves it). ``device``: Megatron's scale as a device tensor, which
    is cloned, not read, and must not change with the scaler's in-place update."""
    megatron, deepspeed = MegatronOptimizer(), DeepSpeedOptimizer()
    scaler: Any = {"megatron": megatron, "deepspeed": deepspeed, "device": megatron}.get(
        kind, lambda: deepspeed.cur
    )
    context = (
        device_rank(tmp_path, transport, monkeypatch) if kind == "device" else attach(tmp_path, transport)
    )
    with context as rh:
        rh.watch(scaler=scaler)
        for _ in range(2):
            rh.window_start()
            rh.loss(torch.tensor(1.0), tokens=1)
            rh.window_end()
            megatron.scale.mul_(0.5)  # in place: a device clone keeps the window's value
            deepspeed.cur /= 2
        assert rh.counters["hook_errors"] == 0
    first = 4096.0 if kind in ("deepspeed", "function") else 65536.0
    assert [s["loss_scale"] for s in transport.records("step")] == [first, first / 2]


def test_an_object_that_is_no_loss_scaler_is_refused_once_at_attach(
    tmp_path: Path, transport: RecordingTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a failure at every window: one logged refusal naming what is accepted, and the
    windows are stored without a scale."""
    with attach(tmp_path, transport, scaler=object()) as rh:
        for _ in range(2):
            rh.window_start()
            rh.loss(torch.tensor(1.0), tokens=1)
            rh.window_end()
        assert rh.counters["hook_errors"] == 1
    assert "is not a loss scaler; pass a torch GradScaler" in caplog.text
    steps = transport.records("step")
    assert len(steps) == 2 and not any("loss_scale" in s for s in steps)


class DeviceFlag(torch.Tensor):
    """A found-inf flag as a fused optimizer on a GPU sees it: not on the CPU."""

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False


def test_a_device_only_skip_verdict_is_resolved_when_the_record_is_rendered(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        for found_inf in (0.0, 1.0, 0.0):
            rh.window_start()
            rh.loss(torch.tensor(1.0), tokens=1)
            optimizer.found_inf = torch.tensor(found_inf).as_subclass(DeviceFlag)  # type: ignore[attr-defined]
            rh._windows._after_optimizer_step(optimizer, (), {})  # as the step post-hook calls it
            rh.window_end()
    steps = transport.records("step")
    assert [(s["step"], s["skipped"]) for s in steps] == [(1, False), (1, True), (2, False)]
    assert rh.progress["step"] == 2


def test_a_window_per_microbatch_it_cannot_merge_is_told_once_how_to_attach(
    tmp_path: Path, transport: RecordingTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that opens a window per microbatch and updates every 4th is merged into one window
    per update when its gradients accumulate in the parameters (``test_collectors_accumulation``).
    Here they accumulate where the hook cannot see them (moved to a buffer of the trainer's own
    after each backward, as a sharding engine keeps them): each window without an update is
    recorded as skipped, and the hook says once, at the third, how to attach the loop."""
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffers = [torch.zeros_like(p) for p in model.parameters()]
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        for index in range(12):
            rh.window_start()
            loss = lm_loss(model, torch.randint(0, VOCAB, (2, 8)))
            rh.loss(loss, tokens=14)
            loss.backward()  # type: ignore[no-untyped-call]
            for parameter, buffer in zip(model.parameters(), buffers, strict=True):
                assert parameter.grad is not None
                buffer += parameter.grad
                parameter.grad = None
            if index % 4 == 3:
                for parameter, buffer in zip(model.parameters(), buffers, strict=True):
                    parameter.grad = buffer.clone()
                    buffer.zero_()
                optimizer.step()
                optimizer.zero_grad()
            rh.window_end()
    steps = transport.records("step")
    assert [s["skipped"] for s in steps] == [True, True, True, False] * 3
    notes = [r.getMessage() for r in caplog.records if "without an optimizer update" in r.getMessage()]
    assert len(notes) == 1 and "rh.windows(loader, microbatches=K)" in notes[0]


def test_a_skip_without_a_scale_change_is_still_a_skip(tmp_path: Path, transport: RecordingTransport) -> None:
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        for index, batch in enumerate(rh.windows(batches(3))):
            loss = lm_loss(model, batch["tokens"])
            rh.loss(loss, labels=batch["tokens"])
            loss.backward()
            if index != 1:  # the trainer's own guard skipped the update
                optimizer.step()
            optimizer.zero_grad()
    steps = transport.records("step")
    assert [(s["step"], s["skipped"]) for s in steps] == [(1, False), (1, True), (2, False)]


def test_an_accumulation_window_sums_its_microbatches(tmp_path: Path, transport: RecordingTransport) -> None:
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, tokens = [], []
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        for batch in rh.windows(batches(8), sample_ids=lambda b: b["ids"], microbatches=4):
            labels = batch["tokens"].clone()
            labels[0, :5] = -100  # masked prompt tokens
            loss = torch.nn.functional.cross_entropy(
                model(batch["tokens"])[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
            )
            rh.loss(loss, labels=labels)
            (loss / 4).backward()  # type: ignore[no-untyped-call]
            losses.append(float(loss.detach()))
            tokens.append(int((labels[:, 1:] != -100).sum()))
            if len(losses) % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    steps = transport.records("step")
    assert [s["microbatches"] for s in steps] == [4, 4]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["tokens"] == sum(tokens[:4]) == 4 * (32 - 4)
    weighted = sum(loss * count for loss, count in zip(losses[:4], tokens[:4], strict=True))
    assert steps[0]["loss_sum"] == pytest.approx(weighted, rel=1e-6)
    assert steps[0]["reported_loss"] == pytest.approx(sum(losses[:4]) / 4, rel=1e-6)
    assert steps[0]["sample_ids"] == list(range(16)) and steps[0]["consumed"] == 16


def test_sum_reduction_and_unknown_tokens(tmp_path: Path, transport: RecordingTransport) -> None:
    with attach(tmp_path, transport) as rh:
        rh.window_start(examples=2)
        rh.loss(torch.tensor(12.0), tokens=6, reduction="sum")
        rh.window_end()
        rh.window_start(examples=2)
        rh.loss(torch.tensor(3.0))  # a mean with no count: the sum is unknown
        rh.window_end()
    first, second = transport.records("step")
    assert (first["loss_sum"], first["tokens"], first["reported_loss"]) == (12.0, 6, 2.0)
    assert "loss_sum" not in second and "tokens" not in second and second["reported_loss"] == 3.0
    assert "skipped" not in first  # no optimizer watched: no judgement
    assert [first["consumed"], second["consumed"]] == [2, 4]


def test_nonfinite_values_travel_by_name(tmp_path: Path, transport: RecordingTransport) -> None:
    with attach(tmp_path, transport) as rh:
        rh.window_start()
        rh.loss(torch.tensor(math.nan), tokens=torch.tensor(3.0))
        rh.grad_norm(torch.tensor(-math.inf))
        rh.window_end()
    (step,) = transport.records("step")
    assert (step["loss_sum"], step["reported_loss"], step["grad_norm"]) == ("NaN", "NaN", "-Infinity")


def test_the_hook_never_raises_into_training(tmp_path: Path, transport: RecordingTransport) -> None:
    with attach(tmp_path, transport) as rh:
        rh.window_start()
        rh.loss("not a tensor")
        rh.grad_norm(object())
        rh.window_end()  # the bad window is lost (and counted), training is not
        rh.window_start()
        rh.loss(torch.tensor(1.0), tokens=2)
        rh.window_end()
    assert rh.counters["hook_errors"] >= 1
    assert [s["attempt"] for s in transport.records("step")] == [2]


def test_run_start_and_finish_from_rank_zero(tmp_path: Path, transport: RecordingTransport) -> None:
    with attach(tmp_path, transport, run_config={"lr": 0.1, "bad": math.nan}) as rh:
        pass
    (start,) = transport.records("run_start")
    (finish,) = transport.records("run_finish")
    assert start["world_size"] == 1 and start["layout"] == {"dp": 1, "tp": 1, "pp": 1, "cp": 1}
    hook_settings = start["config"].pop("runhealth_hook")
    assert start["config"] == {"lr": 0.1, "bad": "NaN"}
    assert hook_settings["agree_every"] >= 1 and hook_settings["directive_poll_s"] > 0
    assert hook_settings["heartbeat_s"] == rh.config.sender.heartbeat_interval_s
    assert start["incarnation"] == finish["incarnation"] == rh.incarnation
    assert finish["status"] == "completed"


# Heartbeats and hang evidence.


def test_heartbeats_continue_while_the_training_thread_is_stuck(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    config = hook_config(tmp_path, heartbeat_interval_s=0.05)
    with attach(tmp_path, transport, config=config) as rh:
        rh.window_start()
        entered = time.time()
        stuck = threading.Event()
        stuck.wait(0.6)  # the training thread blocked, as in a hung collective
        beats = [b for b in transport.records("heartbeat") if b["time"] > entered + 0.1]
        rh.window_end()
    assert len(beats) >= 3
    assert {b["phase"] for b in beats} == {"forward"}
    assert {b["phase_since"] for b in beats} == {beats[0]["phase_since"]}
    assert beats[0]["phase_since"] <= entered and beats[0]["attempt"] == 1 and beats[0]["step"] == 0
    assert transport.records("heartbeat")[-1]["phase"] == "closed"


def test_a_declared_save_is_its_own_phase_in_the_heartbeats_and_not_in_the_windows_timings(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """``rh.checkpoint_saving()`` to ``checkpoint_saved``: heartbeats say ``saving`` (the hang
    rule gives it a save's timeout), then ``data`` again from the end of the save."""
    config = hook_config(tmp_path, heartbeat_interval_s=0.05)
    with attach(tmp_path, transport, config=config) as rh:
        rh.window_start()
        rh.loss(1.0, tokens=4)
        rh.window_end()
        rh.checkpoint_saving()
        saving_from = time.time()
        threading.Event().wait(0.3)  # writing the files
        rh.checkpoint_saved(1, tmp_path / "ckpt.pt", hash_files=False)
        saved_at = time.time()
        threading.Event().wait(0.2)
        rh.window_start()
        rh.loss(1.0, tokens=4)
        rh.window_end()
    beats = transport.records("heartbeat")
    saving = [b for b in beats if b["phase"] == "saving"]
    assert saving and all(abs(b["phase_since"] - saving_from) < 0.05 for b in saving)
    after = [b for b in beats if saving_from + 0.3 < b["time"] < saved_at + 0.2]
    assert after and after[-1]["phase"] == "data" and after[-1]["phase_since"] >= saving_from + 0.29
    assert len(transport.records("step")) == 2 and rh.counters["hook_errors"] == 0


@contextlib.contextmanager
def compiled_and_attached(
    tmp_path: Path, transport: RecordingTransport, backend: Any, heartbeat_s: float
) -> Iterator[tuple[RunHealth, Any]]:
    """A ``TinyLM`` compiled with ``backend``, and a hook watching it that beats every
    ``heartbeat_s``."""
    model = TinyLM()
    compiled = torch.compile(model, backend=backend)
    config = hook_config(tmp_path, heartbeat_interval_s=heartbeat_s)
    with attach(tmp_path, transport, config=config, model=model) as rh:
        yield rh, compiled


def test_a_compiling_forward_is_its_own_phase_in_the_heartbeats_and_forward_again_after(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """A ``torch.compile`` model's first forward: while TorchDynamo compiles (a backend that
    takes 0.4 s here, as inductor takes seconds to minutes), heartbeats say ``compiling`` (the
    hang rule gives it a save's timeout, not the 9 s of a training phase); after it, ``forward``
    again, timed from the compile's end. The window's forward time still includes it, and the
    next forward (compiled already) has no compiling phase."""
    import torch._dynamo

    torch._dynamo.reset()
    seen: list[str] = []
    states: list[Any] = []

    def slow_backend(graph: Any, _inputs: Any) -> Any:
        seen.append(rh._windows.phases.state.phase.value)
        threading.Event().wait(0.4)
        return graph.forward

    with compiled_and_attached(tmp_path, transport, slow_backend, heartbeat_s=0.05) as (rh, compiled):
        for batch in rh.windows(batches(2)):
            loss = lm_loss(compiled, batch["tokens"])
            states.append(rh._windows.phases.state)
            rh.loss(loss, tokens=32)
        compiled_from = min(
            b["phase_since"] for b in transport.records("heartbeat") if b["phase"] == "compiling"
        )
    torch._dynamo.reset()
    beats = transport.records("heartbeat")
    compiling = [b for b in beats if b["phase"] == "compiling"]
    assert seen and set(seen) == {"compiling"} and compiling
    assert {b["phase_since"] for b in compiling} == {compiled_from}
    # Forward again once the compile ended, timed from its end (the state heartbeats read).
    assert [s.phase for s in states] == [Phase.FORWARD, Phase.FORWARD]
    assert rh._windows.phases.epoch(states[0].since) >= compiled_from + 0.35
    first, second = transport.records("step")
    assert first["forward_s"] >= 0.35 and second["forward_s"] < 0.35
    assert rh.counters["hook_errors"] == 0 and not rh._compiles.installed  # removed at close


def test_after_the_update_heartbeats_say_data_while_the_window_stays_open(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """A loop that saves inside ``rh.windows()`` after its update (Hugging Face's examples): the
    save is not a training phase (its hang timeout would be 10 steps), so heartbeats say ``data``
    from the optimizer step on, and after a second optimizer's step too; the window is recorded
    with its updates and its timings as before (the optimizer phase still ends at its end)."""
    model = TinyLM()
    first, second = (
        torch.optim.SGD(model.embed.parameters(), lr=0.1),
        torch.optim.SGD(model.head.parameters(), lr=0.1),
    )
    config = hook_config(tmp_path, heartbeat_interval_s=0.05)
    with attach(tmp_path, transport, config=config, model=model, optimizer=[first, second]) as rh:
        batch = torch.randint(0, VOCAB, (2, 6))
        rh.window_start()
        loss = lm_loss(model, batch)
        rh.loss(loss, labels=batch)
        loss.backward()
        first.step()
        assert rh._windows.phases.state.phase == "data"
        stepped = time.time()
        threading.Event().wait(0.3)  # writing a checkpoint in the loop
        second.step()  # its pre-hook enters the optimizer phase again, its post-hook leaves it
        threading.Event().wait(0.2)
        rh.window_end()
    beats = [b for b in transport.records("heartbeat") if stepped + 0.05 < b["time"] < stepped + 0.3]
    assert beats and {b["phase"] for b in beats} == {"data"}, beats
    (step,) = transport.records("step")
    assert step["step"] == 1 and not step["skipped"] and step["optimizer_s"] >= 0.5, step


def test_a_stack_dump_shows_every_thread() -> None:
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="stuck-in-collective")
    worker.start()
    try:
        dump = dump_stacks(nccl_trace=True)
    finally:
        release.set()
        worker.join()
    assert "stuck-in-collective" in dump.threads and "MainThread" in dump.threads
    assert "test_a_stack_dump_shows_every_thread" in dump.threads
    # No NCCL process group here: the recorder answers with an empty trace.
    assert dump.flight_recorder is not None and '"version"' in dump.flight_recorder
    assert dump.flight_recorder in dump.text()
    assert dump_stacks().flight_recorder is None  # only when asked (the recorder is on)


# Checkpoints and resumes.


def test_checkpoint_saved_records_a_manifest(tmp_path: Path, transport: RecordingTransport) -> None:
    checkpoint = tmp_path / "ckpt-40"
    (checkpoint / "shards").mkdir(parents=True)
    (checkpoint / "shards" / "model.pt").write_bytes(b"weights" * 100)
    (checkpoint / "optim.pt").write_bytes(b"moments")
    (checkpoint / "manifest.json").write_text("{}")
    manifest = build_manifest(checkpoint, step=40, consumed=160)
    assert [f["path"] for f in manifest["files"]] == ["optim.pt", "shards/model.pt"]
    assert manifest["files"][1]["size"] == 700
    assert manifest["files"][0]["sha256"] == hashlib.sha256(b"moments").hexdigest()
    with attach(tmp_path, transport) as rh:
        rh.checkpoint_saved(40, str(checkpoint), manifest=manifest, tags=["latest"], metrics={"loss": 2.5})
    (event,) = transport.records("checkpoint")
    assert event["step"] == 40 and event["consumed"] == 160 and event["tags"] == ["latest"]
    assert event["manifest"] == manifest and event["incarnation"] == rh.incarnation
    assert event["node"] == "node-a" and event["manifest_digest"] == manifest_digest(manifest)


def test_checkpoint_saved_returns_at_once_and_hashes_a_relative_file_on_its_own_thread(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rh.checkpoint_saved(step, "out/ckpt.pt")``: the path is the trainer's, made absolute at
    the call; the manifest is built by the manifest worker, and the record sent when it is."""
    hashed_on: list[str] = []
    real_sha256 = checkpoints_module.sha256_of
    release = threading.Event()

    def sha256_of(path: Path) -> str:
        hashed_on.append(threading.current_thread().name)
        release.wait(10)  # the training thread would wait here, were it the one hashing
        return real_sha256(path)

    monkeypatch.setattr(checkpoints_module, "sha256_of", sha256_of)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ckpt.pt").write_bytes(b"weights" * 1000)
    config = dataclasses.replace(hook_config(tmp_path), hook=HookConfig(manifest_settle_s=0.05))
    with attach(tmp_path, transport, config=config) as rh:
        started = time.perf_counter()
        rh.checkpoint_saved(12, "out/ckpt.pt", consumed=48)
        returned_after = time.perf_counter() - started
        release.set()
    assert returned_after < 5  # it did not wait for the hash
    (event,) = transport.records("checkpoint")
    assert event["path"] == str(tmp_path / "out" / "ckpt.pt") and event["node"] == "node-a"
    sha = hashlib.sha256(b"weights" * 1000).hexdigest()
    assert event["manifest"] == {
        "step": 12,
        "consumed": 48,
        "files": [{"path": ".", "size": 7000, "sha256": sha}],
    }
    assert event["manifest_digest"] == manifest_digest(event["manifest"])
    assert hashed_on == ["runhealth-manifests"]
    assert rh.counters.get("hook_errors", 0) == 0


def test_checkpoint_saved_without_hashing_records_no_manifest(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    (tmp_path / "ckpt.pt").write_bytes(b"w")
    with attach(tmp_path, transport) as rh:
        rh.checkpoint_saved(3, str(tmp_path / "ckpt.pt"), hash_files=False)
    (event,) = transport.records("checkpoint")
    assert "manifest" not in event and event["manifest_digest"] == ""


def test_events_handed_over_before_start_are_sent_at_start(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    rh = RunHealth(config=hook_config(tmp_path), transport=transport, environ={}, hostname=lambda: "n")
    rh.checkpoint_saved(10, "ckpt-10")
    rh.submit({"kind": "link_sample", "node": "n", "device": "mlx5_0", "port": 1, "seq": 0, "time": 1.0})
    with rh.start():
        pass
    assert transport.records("checkpoint")[0]["incarnation"] == rh.incarnation
    assert "incarnation" not in transport.records("link_sample")[0]


def test_resumed_records_what_the_restart_restored(tmp_path: Path, transport: RecordingTransport) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    for batch in batches(3):
        lm_loss(model, batch["tokens"]).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    saved = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
    }
    moment_norm = math.sqrt(sum(float(s["exp_avg"].norm()) ** 2 for s in optimizer.state.values()))

    restarted = TinyLM()
    optimizer2 = torch.optim.AdamW(restarted.parameters(), lr=1e-3)
    schedule2 = torch.optim.lr_scheduler.LambdaLR(optimizer2, lambda step: min(1.0, (step + 1) / 10))
    restarted.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    schedule2.load_state_dict(saved["schedule"])
    with attach(tmp_path, transport, model=restarted, optimizer=optimizer2, scheduler=schedule2) as rh:
        rh.resumed(checkpoint_path="ckpt-3", consumed=12)
        for batch in rh.windows(batches(1, seed=7), sample_ids=lambda b: [f"s{i}" for i in b["ids"]]):
            lm_loss(restarted, batch["tokens"]).backward()
            optimizer2.step()
            optimizer2.zero_grad()
    (resume,) = transport.records("resume")
    restored = resume["restored"]
    assert restored["optimizer"]["optimizer_step_max"] == 3
    assert restored["optimizer"]["exp_avg_norm"] == pytest.approx(moment_norm, rel=1e-6)
    assert restored["optimizer"]["exp_avg_sq_norm"] > 0
    assert restored["scheduler"]["last_epoch"] == 3
    assert restored["scheduler"]["last_lr"] == pytest.approx([4e-4])
    assert restored["consumed"] == 12 and restored["resumed_step"] == 3
    assert restored["first_sample_ids"] == ["s0", "s1", "s2", "s3"]
    assert resume["checkpoint_path"] == str(Path.cwd() / "ckpt-3")  # absolute, as checkpoints are
    (step,) = transport.records("step")
    assert (step["attempt"], step["step"], step["consumed"]) == (1, 4, 16)


# The ring and the phase clock, with markers the test completes.


def test_the_ring_hands_back_windows_in_order_once_their_copy_completed() -> None:
    markers: list[FakeMarker] = []

    def new_marker() -> FakeMarker:
        markers.append(FakeMarker())
        return markers[-1]

    ring = PinnedRing[str](RingConfig(slots=3, width=4), device=torch.device("cpu"), new_marker=new_marker)
    ring.push([torch.tensor(1.5), torch.tensor(2.0, dtype=torch.float64)], "a")
    ring.push([torch.tensor(3.0)], "b")
    ring.push([], "c")
    assert ring.full and not ring.pop_ready()
    slot_of = {slot.meta: cast(FakeMarker, slot.done) for slot in ring._busy}
    slot_of["b"].done = True
    assert ring.pop_ready() == []  # "a" is older and still in flight
    slot_of["a"].done = True
    assert ring.pop_ready() == [("a", [1.5, 2.0]), ("b", [3.0])]
    assert not ring.full and len(ring) == 1
    assert ring.pop_oldest() == ("c", [])
    assert slot_of["c"].waited == 1


class CopySpy(torch.Tensor):
    """A ring's host buffer that notes how each copy into it was asked for."""

    copies: ClassVar[list[bool]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_:
            cls.copies.append(bool((kwargs or {}).get("non_blocking", False)))
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize(("device_type", "asynchronous"), [("cuda", True), ("mps", False), ("xpu", False)])
def test_the_host_copy_is_asynchronous_only_where_an_event_says_when_it_landed(
    device_type: str, asynchronous: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off CUDA a ring slot's marker is a wall clock, complete when recorded, so an async copy
    could still be in flight when the slot is read (MPS's non-blocking copies are known to give
    wrong values): there the copy blocks. Pinned buffers are faked (no CUDA here)."""
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: torch.zeros(*a, **k))
    ring = PinnedRing[int](RingConfig(), device=torch.device(device_type), new_marker=WallMarker)
    monkeypatch.undo()
    monkeypatch.setattr(CopySpy, "copies", [])
    for slot in ring._free:
        slot.host = slot.host.as_subclass(CopySpy)
    ring.push([torch.tensor(2.5), torch.tensor(3)], 7)
    assert CopySpy.copies == [asynchronous]
    assert ring.pop_ready() == [(7, [2.5, 3.0])]


@pytest.mark.parametrize(
    "values",
    [
        [torch.tensor(0.1), torch.tensor(2.0, dtype=torch.float64)],  # float types: one stack, one cast
        [torch.tensor(0.1), torch.tensor(2.0)],
        [torch.tensor(2**40 + 1)],  # a count past fp32's integers
        [torch.tensor(2.5, dtype=torch.bfloat16), torch.tensor(32767), torch.tensor(0.1)],
    ],
)
def test_the_ring_packs_each_value_unrounded(values: list[torch.Tensor]) -> None:
    ring = PinnedRing[int](RingConfig(), device=torch.device("cpu"), new_marker=WallMarker)
    ring.push(values, 1)
    assert ring.pop_ready() == [(1, [value.item() for value in values])]


def test_host_buffers_are_pinned_only_for_cuda() -> None:
    ring = PinnedRing[int](RingConfig(), device=torch.device("cpu"), new_marker=WallMarker)
    assert not any(slot.host.is_pinned() for slot in ring._free)
    with pytest.raises(ValueError):
        ring.push([torch.tensor(0.0)] * 9, 0)


def tensors_as_device_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take CPU tensors for device tensors: in ``on_device``, in the hook's all-on-the-host
    fast path, which checks inline (it runs every step). The hook must also not take itself for
    a CPU rank (``as_device_rank``)."""
    monkeypatch.setattr("collectors.window.on_device", lambda value: hasattr(value, "is_cpu"))
    monkeypatch.setattr("collectors.accounting.settle_on_host", lambda microbatches: None)
    monkeypatch.setattr("collectors.window.WindowValues.scalars_on_host", lambda self: False)


def as_device_rank(rh: RunHealth) -> RunHealth:
    """A CPU rank hands its windows to the sender as they are; an accelerator's goes through
    the ring."""
    rh._windows._host_rank = False
    return rh


def test_device_values_travel_through_the_ring(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU run has nothing on a device; here CPU tensors are taken for device tensors, so the
    hook's ring path (pack, copy, markers, a full ring) runs as it does on a GPU."""
    tensors_as_device_tensors(monkeypatch)
    config = dataclasses.replace(hook_config(tmp_path), ring=RingConfig(slots=2))
    markers: list[FakeMarker] = []

    def pending_marker() -> FakeMarker:
        markers.append(FakeMarker())
        return markers[-1]

    with attach(tmp_path, transport, config=config) as rh:
        as_device_rank(rh)
        rh._windows._ring = PinnedRing(config.ring, device=torch.device("cpu"), new_marker=pending_marker)
        for attempt in range(1, 4):
            rh.window_start()
            for _ in range(2):
                rh.loss(torch.tensor(float(attempt)), labels=torch.ones(1, 5, dtype=torch.long))
            rh.grad_norm(torch.tensor(0.5))
            rh.window_end()
        assert rh.counters["ring_waits"] == 1  # the third window found the ring full
        assert sorted(m.waited for m in markers) == [0, 1]
        assert wait_until(lambda: [s["attempt"] for s in transport.records("step")] == [1], 2.0)
    steps = transport.records("step")
    assert [s["attempt"] for s in steps] == [1, 2, 3]  # the rest at close
    assert [(s["tokens"], s["loss_sum"], s["reported_loss"]) for s in steps] == [
        (8, 8.0, 1.0),
        (8, 16.0, 2.0),
        (8, 24.0, 3.0),
    ]
    assert {s["grad_norm"] for s in steps} == {0.5}


def test_a_device_loss_with_a_host_token_count(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device loss, count given as an int or from CPU labels: the sum is a device op, the count
    a host number; both arrive in one record."""
    tensors_as_device_tensors(monkeypatch)
    with attach(tmp_path, transport) as rh:
        as_device_rank(rh)
        rh.window_start()
        rh.loss(torch.tensor(2.0), tokens=3)
        rh.loss(torch.tensor(4.0), labels=torch.tensor([[1, 2, -100]]))
        rh.window_end()
    (step,) = transport.records("step")
    assert (step["tokens"], step["loss_sum"], step["reported_loss"]) == (4, 2.0 * 3 + 4.0 * 1, 3.0)


@contextlib.contextmanager
def device_rank(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RunHealth]:
    """An attached hook that takes CPU tensors for device tensors, with a CPU ring."""
    tensors_as_device_tensors(monkeypatch)
    with attach(tmp_path, transport) as rh:
        as_device_rank(rh)
        rh._windows._ring = PinnedRing(RingConfig(), device=torch.device("cpu"), new_marker=FakeMarker)
        yield rh


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_device_loss_keeps_its_sums_and_token_counts_exact(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """A model trained in fp16 or bf16 without autocast gives a half-precision loss. Its sum over
    a microbatch's tokens must not be taken in that precision (an fp16 loss of 10 over 8,192
    tokens overflows to inf: a nonfinite incident on a healthy run), and the window's values must
    not be packed through it (bf16 holds integers exactly only to 256: 32,767 tokens became
    32,768; fp16 makes 100,001 inf)."""
    losses = [10.0, 2.203125, 2.5]  # each exact in both dtypes
    counts = [8192, 32767, 100001 - 8192 - 32767]
    with device_rank(tmp_path, transport, monkeypatch) as rh:
        rh.window_start()
        for loss, count in zip(losses, counts, strict=True):
            rh.loss(torch.tensor(loss, dtype=dtype), tokens=torch.tensor(count))  # counted on the device
        # A norm the trainer computed differentiably: it still requires grad.
        rh.grad_norm(torch.tensor(0.5, dtype=dtype, requires_grad=True) * 1)
        rh.window_end()
    (step,) = transport.records("step")
    assert step["tokens"] == sum(counts) == 100001
    assert step["loss_sum"] == pytest.approx(
        sum(x * n for x, n in zip(losses, counts, strict=True)), rel=1e-6
    )
    assert step["reported_loss"] == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert step["grad_norm"] == 0.5


def test_a_device_loss_of_shape_one_is_taken_as_a_scalar(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss of shape ``[1]`` (gathered across replicas, or cut from a concatenation) and its
    token count of the same shape: the window lands as a 0-dim loss's would (it was lost to a
    failed stack, one hook error a window)."""
    with device_rank(tmp_path, transport, monkeypatch) as rh:
        for _ in range(2):
            rh.window_start()
            rh.loss(torch.tensor([2.0]), tokens=torch.tensor([3]))
            rh.loss(torch.tensor(4.0), tokens=torch.tensor(1))
            rh.grad_norm(torch.tensor([0.5]))
            rh.window_end()
        assert rh.counters["hook_errors"] == 0
    steps = transport.records("step")
    assert [(s["tokens"], s["loss_sum"], s["reported_loss"], s["grad_norm"]) for s in steps] == [
        (4, 10.0, 3.0, 0.5)
    ] * 2


def test_a_dtensor_loss_lands_as_its_local_value(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor parallelism's ``loss_parallel`` gives a replicated DTensor loss. On a device its
    window was lost: a DTensor cannot be stacked into, or copied to, the ring's plain tensors.
    Here a real DTensor on a one-rank gloo mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        with device_rank(tmp_path, transport, monkeypatch) as rh:
            rh.window_start()
            rh.loss(DTensor.from_local(torch.tensor(2.5), mesh, [Replicate()]), tokens=torch.tensor(4))
            rh.grad_norm(DTensor.from_local(torch.tensor(0.5), mesh, [Replicate()]))
            rh.window_end()
            assert rh.counters["hook_errors"] == 0
    finally:
        torch.distributed.destroy_process_group()
    (step,) = transport.records("step")
    assert (step["tokens"], step["loss_sum"], step["reported_loss"], step["grad_norm"]) == (4, 10.0, 2.5, 0.5)


class Placed(torch.Tensor):
    """A tensor on one of two accelerators of one process, faked at the one rule that matters
    here: an op mixing the two devices fails, as CUDA's do, and ``.to(device)`` moves a tensor.
    Plain tensors (the ring's buffers) are on neither."""

    place: torch.device

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.place

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            (target,) = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.device)]
            return args[0].as_subclass(torch.Tensor).clone().as_subclass(placed_on(target))
        flat = [
            a for arg in (*args, *kwargs.values()) for a in (arg if isinstance(arg, list | tuple) else [arg])
        ]
        if len({type(a) for a in flat if isinstance(a, Placed)}) > 1:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices"
            )
        return super().__torch_function__(func, types, args, kwargs)


class FirstDevice(Placed):
    place = torch.device("cpu")


class LastDevice(Placed):
    place = torch.device("cpu", 0)  # unequal to the first: real CPU memory all the same


def placed_on(device: torch.device) -> type[Placed]:
    return FirstDevice if device == FirstDevice.place else LastDevice


def test_a_model_split_over_two_devices_in_one_process_stores_its_windows(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process, a model split over two accelerators (``device_map="auto"``): the loss and the
    scaler's scale on the last device, the labels and the grad norm on the first. The count is
    moved to the loss's device and the window's values to the hook's (the model's first
    parameter's, whose stream orders the ring's copies) before they are stacked; each window was
    lost to a cross-device op, one hook error a window."""
    with device_rank(tmp_path, transport, monkeypatch) as rh:
        for _ in range(2):
            rh.window_start()
            for loss in (2.0, 4.0):
                labels = torch.tensor([[0, 5, 7, -100]]).as_subclass(FirstDevice)  # 2 tokens once shifted
                rh.loss(torch.tensor(loss).as_subclass(LastDevice), labels=labels)
            rh.grad_norm(torch.tensor(0.5).as_subclass(FirstDevice))
            rh.window_end()
        assert rh.counters["hook_errors"] == 0
    steps = transport.records("step")
    assert [(s["tokens"], s["reported_loss"], s["grad_norm"]) for s in steps] == [(4, 3.0, 0.5)] * 2


class ListedStamps:
    """Stamps the test chooses, one per phase change."""

    def __init__(self, times: list[float]) -> None:
        self._times = iter(times)

    def stamp(self) -> float:
        return next(self._times)

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def release(self, stamps: list[Any]) -> None:
        return None


def test_phase_timings_add_up_each_phase() -> None:
    stamps = ListedStamps([1.0, 2.0, 3.0, 4.0, 10.0, 12.0])
    clock = PhaseClock(stamps, max_marks=16)
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.DATA):
        clock.enter(phase)
    # forward 1-2 and 3-4, backward 2-3 and 4-10, optimizer 10-12
    assert durations(*clock.take_window(), stamps) == {
        Phase.FORWARD: 2.0,
        Phase.BACKWARD: 7.0,
        Phase.OPTIMIZER: 2.0,
    }
    assert clock.state.phase is Phase.DATA
    assert abs(clock.epoch(clock.state.since) - time.time()) < 1.0


def test_a_window_with_too_many_phase_changes_reports_unknown_timings() -> None:
    clock = PhaseClock(WallStamps(), max_marks=3)
    for phase in (Phase.FORWARD, Phase.BACKWARD) * 3:
        clock.enter(phase)
    assert durations(*clock.take_window(), WallStamps()) is None
    assert durations((), True, WallStamps()) is None


def test_cpu_ranks_are_timed_by_their_threads_work_and_a_single_process_by_the_wall() -> None:
    assert isinstance(stamps_for("cpu", world_size=1), WallStamps)  # no peer, no system call
    assert isinstance(stamps_for("cuda", world_size=1), CudaStamps)
    # With peers, a rank that waits in a collective or for a shared core is not a slow device.
    assert isinstance(stamps_for("cpu", world_size=4), CpuStamps)
    stamps = CpuStamps()
    clock = PhaseClock(stamps, max_marks=8)
    clock.enter(Phase.FORWARD)
    busy_until = time.thread_time() + 0.03  # a loaded machine stretches this in wall time
    while time.thread_time() < busy_until:
        pass
    clock.enter(Phase.BACKWARD)
    time.sleep(0.1)
    clock.enter(Phase.DATA)
    marks, complete = clock.take_window()
    spent = durations(marks, complete, stamps)
    assert spent is not None
    assert spent[Phase.FORWARD] >= 0.03
    assert spent[Phase.BACKWARD] < 0.02
    # Their wall times go beside them: the sleeping phase shows there (``wall_durations``).
    assert clock.wall_apart and not PhaseClock(WallStamps(), max_marks=8).wall_apart
    wall = wall_durations(marks, complete)
    assert wall is not None and wall[Phase.BACKWARD] >= 0.1 and wall[Phase.FORWARD] >= 0.03
    assert wall_durations(marks, False) is None


# Layout, configuration, packaging.


class FakeMesh:
    mesh_dim_names = ("pp", "dp_replicate", "dp_shard", "tp")
    shape = (2, 2, 4, 2)

    def get_coordinate(self) -> tuple[int, ...]:
        return (1, 1, 2, 0)

    def size(self, dim: int) -> int:
        return self.shape[dim]


def test_layout_from_a_device_mesh_combines_the_data_parallel_dimensions() -> None:
    layout = layout_from_mesh(FakeMesh())
    assert layout.dp == Coordinate(1 * 4 + 2, 8)
    assert layout.pp == Coordinate(1, 2) and layout.tp == Coordinate(0, 2) and layout.cp == Coordinate()
    assert layout.ranks() == {"dp_rank": 6, "tp_rank": 0, "pp_rank": 1, "cp_rank": 0}


def test_layout_from_process_groups() -> None:
    class Dist:
        def get_rank(self, group: str) -> int:
            return {"dp": 3, "tp": 1}[group]

        def get_world_size(self, group: str) -> int:
            return {"dp": 4, "tp": 2}[group]

    layout = layout_from_groups({"dp": "dp", "tp": "tp"}, Dist())
    assert layout.sizes() == {"dp": 4, "tp": 2, "pp": 1, "cp": 1}
    with pytest.raises(ValueError, match="named dp"):
        layout_from_groups({"ep": "ep"}, Dist())


def test_configuration_from_an_injected_environment() -> None:
    config = RunHealthConfig.from_environ(
        {
            "RUNHEALTH_URL": "http://monitor:8765",
            "RUNHEALTH_TOKEN": "tok",
            "RUNHEALTH_RUN": "policy-sft-v4",
            "RUNHEALTH_HEARTBEAT_S": "2.5",
            "RUNHEALTH_SPOOL_DIR": "/var/spool/rh",
            "RUNHEALTH_DB": "/local/rh.db",
            "TORCH_FR_BUFFER_SIZE": "2000",
        }
    )
    assert (config.transport.url, config.transport.token, config.transport.run) == (
        "http://monitor:8765",
        "tok",
        "policy-sft-v4",
    )
    assert config.sender.heartbeat_interval_s == 2.5 and config.spool.directory == "/var/spool/rh"
    assert config.embedded.db == "/local/rh.db" and config.hook.nccl_trace
    assert RunHealthConfig.from_environ({}) == RunHealthConfig()
    with pytest.raises(ConfigError, match="RUNHEALTH_HEARTBEAT_S"):
        RunHealthConfig.from_environ({"RUNHEALTH_HEARTBEAT_S": "often"})
    with pytest.raises(ConfigError, match="http"):
        RunHealthConfig.from_environ({"RUNHEALTH_URL": "monitor:8765"})
    with pytest.raises(ConfigError, match="max_sample_ids"):
        HookConfig(max_sample_ids=200_000)


def test_samplers_hand_records_to_the_hook(tmp_path: Path, transport: RecordingTransport) -> None:
    class Sampler:
        def __init__(self, sink: RecordSink) -> None:
            self.sink = sink
            self.stopped = False

        def start(self) -> None:
            record = {"kind": "link_sample", "node": "node-a", "device": "mlx5_0", "port": 1, "seq": 0}
            self.sink({**record, "time": time.time(), "counters": {"symbol_error": math.nan}})

        def stop(self) -> None:
            self.stopped = True

    with attach(tmp_path, transport) as rh:
        sampler = Sampler(rh.submit)
        rh.add_sampler(sampler)
    (sample,) = transport.records("link_sample")
    assert sample["counters"] == {"symbol_error": "NaN"} and sampler.stopped


def test_importing_collectors_needs_no_torch() -> None:
    program = (
        "import sys; sys.modules['torch'] = None\n"
        "import collectors, collectors.hook, collectors.sender, collectors.spool\n"
        "assert 'monitor' not in sys.modules, 'collectors imported server code'\n"
        "rh = collectors.RunHealth(environ={})\n"
        "rh.start()\n"  # attach fails without torch: logged, the hook stays off
        "rh.window_start(); rh.loss(1.0); rh.window_end(); rh.close()\n"
        "assert rh.counters['hook_errors'] == 1, rh.counters\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, env=child_environ(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_close_is_idempotent_and_records_an_open_window(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    rh = attach(tmp_path, transport)
    rh.window_start(sample_ids=torch.tensor([7, 8]))
    rh.close("stopped")
    rh.close()
    assert wait_until(lambda: bool(transport.records("run_finish")), 1.0)
    assert transport.records("step")[0]["sample_ids"] == [7, 8]
    assert transport.records("run_finish")[0]["status"] == "stopped"


def test_a_window_of_very_many_microbatches_is_folded_and_its_timings_are_unknown(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """Past 64 microbatches the hook folds them (memory stays bounded); past the clock's 128
    phase changes the window's timings are unknown rather than guessed. Every loss counts."""
    with attach(tmp_path, transport) as rh:
        rh.window_start(sample_ids=[1])
        for value in range(150):
            rh.loss(torch.tensor(float(value)), tokens=2)
        rh.window_end()
        rh.window_start(sample_ids=[2])
        rh.loss(torch.tensor(3.0), tokens=2)
        rh.window_end()
    folded, plain = transport.records("step")
    assert folded["microbatches"] == 150 and folded["tokens"] == 300
    assert folded["loss_sum"] == 2 * sum(range(150))
    assert folded["reported_loss"] == pytest.approx(sum(range(150)) / 150)
    assert "forward_s" not in folded and "backward_s" not in folded
    assert plain["loss_sum"] == 6.0 and plain["forward_s"] >= 0 and plain["backward_s"] >= 0


def test_record_times_follow_a_stepped_wall_clock() -> None:
    """Records carry epoch times converted from the monotonic clock; the offset is taken again
    each sender cycle, so a wall clock stepped mid-run (NTP) moves later times with it, while
    sub-millisecond jitter leaves a stuck rank's ``phase_since`` the same number."""
    wall = [1_000.0]
    clock = PhaseClock(WallStamps(), max_marks=8, wall=lambda: wall[0] + time.perf_counter())
    before = clock.epoch(100.0)
    clock.resync()
    assert clock.epoch(100.0) == before
    wall[0] += 3_600.0
    clock.resync()
    assert clock.epoch(100.0) == pytest.approx(before + 3_600.0)


LATER_ROLLBACK = {**ROLLBACK, "act_at_step": 40}  # after the first answers have arrived


class AnsweringTransport(RecordingTransport):
    """Answers every batch with one pending rollback, as the service does when asked with a
    rank; the separate poll answers nothing, and is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.answered = 0
        self.polls = 0

    def post(self, records: Sequence[Record]) -> Delivery:
        self.answered += 1
        return dataclasses.replace(super().post(records), directives=[LATER_ROLLBACK])

    def directives(self, incarnation: str, rank: int) -> list[dict[str, Any]]:
        self.polls += 1
        return []


def test_directives_answered_with_batches_spare_the_separate_poll(tmp_path: Path) -> None:
    transport = AnsweringTransport()
    with directed_hook(transport, tmp_path) as rh:
        deadline = time.monotonic() + 10.0
        while transport.answered < 20 and time.monotonic() < deadline:
            rh.window_start(sample_ids=[rh.progress["attempt"]])
            rh.loss(torch.tensor(1.0), tokens=1)
            rh.window_end()
            time.sleep(0.005)
        polls = transport.polls
        assert rh.should_stop()  # the rollback came only with the batches' answers
        assert rh.directive == {"id": 7, "kind": "rollback", "step": 40, **ROLLBACK["payload"]}
    # A cycle polls only when the one before it sent nothing (the first, before any batch).
    assert transport.answered >= 20 and polls <= 2


def test_a_rate_set_by_hand_after_the_window_starts_is_the_one_recorded(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """nanoGPT-style loops set the rate at the top of each iteration, which may come after
    ``window_start``: the record carries the rate the update used."""
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    tokens = torch.randint(0, VOCAB, (2, 6))
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        for lr in (0.5, 0.25, 0.125):
            rh.window_start()
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = torch.nn.functional.cross_entropy(
                model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
            )
            rh.loss(loss, labels=tokens)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
            rh.window_end()
    assert [s["lr"] for s in transport.records("step")] == [0.5, 0.25, 0.125]


def test_labels_counted_and_scalars_read_in_bulk_give_what_one_by_one_gives() -> None:
    """The sender counts a batch's CPU labels together and reads its CPU scalar tensors
    together (``prepare_batch``): grouped by shape and type, shifted or not, with the ignore
    index; anything else is left to the render."""
    from collectors.window import Counting, PendingWindow, RenderContext, WindowValues, prepare_batch

    generator = torch.Generator().manual_seed(3)

    def labels(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        values = torch.randint(-1, 5, shape, generator=generator)
        return values.masked_fill(values < 0, -100).to(dtype)

    given = [
        labels(4, 9),
        labels(4, 9),
        labels(2, 7),  # another shape
        labels(4, 9, dtype=torch.int32),  # another type
        labels(6),  # one sequence
        labels(4, 9).t(),  # not contiguous
        labels(4, 9).float().requires_grad_(),  # needs grad: left to the render
    ]

    clock = PhaseClock(WallStamps(), 8)  # one epoch offset for both renders
    scalar_types = (torch.float32, torch.float64, torch.bfloat16)

    def drafts(counting: Counting) -> list[Any]:
        context = RenderContext({"rank": 0}, counting, 16, clock)
        made: list[Any] = []
        for attempt, label in enumerate(given):
            window = WindowValues(attempt, None)
            window.microbatches, window.count = [(2.0, label, None)], 1
            window.grad_norm = torch.tensor(0.5 + attempt, dtype=scalar_types[attempt % 3])
            window.lr = torch.tensor(1e-3 * attempt, requires_grad=attempt == 2)
            window.loss_scale = [None, 1024.0, torch.tensor([8.0])][attempt % 3]  # not 0-dim: as is
            window.handed = (context, attempt, None, None, 100.0, ([], False))
            made.append(window)
        settled = WindowValues(99, None)  # through the ring's path: a ``PendingWindow``
        settled.count = 2
        host = [(1.0, given[0], None), (3.0, None, 5.0)]
        made.append(PendingWindow(context, settled, None, host, 1, None, None, 0.0, (), ([], False)))
        return made

    for counting in (Counting(True, -100), Counting(False, -100), Counting(True, 3)):
        one_by_one = [draft.render() for draft in drafts(counting)]
        bulk = drafts(counting)
        prepare_batch(bulk)
        counted = [
            microbatch
            for draft in bulk
            for microbatch in (draft.microbatches if isinstance(draft, WindowValues) else draft.host)
        ]
        assert [labels is None for _, labels, _ in counted] == [True] * 6 + [False, True, True]
        windows = bulk[:-1]
        assert all(type(window.grad_norm) is float for window in windows)
        assert all(type(window.lr) is float for window in windows)
        assert [type(window.loss_scale) for window in windows[:3]] == [type(None), float, torch.Tensor]
        assert [draft.render() for draft in bulk] == one_by_one
        expected = [float(supervised_tokens(label.detach(), shift=counting.shift,
                                            ignore_index=counting.ignore_index)) for label in given]  # fmt: skip
        assert [record["tokens"] for record in one_by_one[:7]] == expected
        assert one_by_one[7]["tokens"] == expected[0] + 5


def test_a_directive_for_this_rank_alone_is_acted_on_at_the_next_window_not_the_next_agreement(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """Ranks agree on directives every ``agree_every`` windows; one for this rank alone (a
    canary re-run: no step to act at) waits for no agreement, only for the next window."""
    rh = attach(tmp_path, transport)
    acted: list[int] = []

    def window() -> None:
        rh.window_start()
        rh.loss(1.0, tokens=4)
        rh.window_end()

    window()  # attempt 1; the next agreement is at attempt 4
    rh._agent.apply([{"id": 7, "kind": "bogus", "act_at_step": None}])  # as the sender would
    for _ in range(2):
        window()
        acted.append(len([a for a in rh._agent.armory.local if a.id == 7]))
    rh.close()
    assert acted == [0, 0]  # gone from the local list at the very next window
    (ack,) = transport.records("directive_ack")
    assert (ack["directive_id"], ack["status"], ack["step"]) == (7, "failed", 1)
    assert "unknown directive kind" in ack["detail"]["reason"]


class StoppedService:
    """Notes how the hook stops the job's embedded service: whether it waited for the ranks,
    and whether they had all said done by then."""

    def __init__(self) -> None:
        self.finished: list[bool | None] = []

    def stop(self, finished: Any) -> None:
        self.finished.append(None if finished is None else finished())


@pytest.mark.parametrize(("status", "finished"), [("completed", True), ("failed", None)])
def test_the_service_rank_waits_for_every_rank_except_after_a_failure(
    tmp_path: Path,
    transport: RecordingTransport,
    status: Literal["completed", "failed"],
    finished: bool | None,
) -> None:
    """Every rank adds one to a counter in the job's store at close; rank 0 stops the service
    once it reaches the world size. After a failure the peers are likely blocked in a
    collective: waiting the ranks timeout (60 s) for them would only delay the exit that tells
    the launcher."""
    hook = attach(tmp_path, transport)
    rendezvous = Rendezvous(torch.distributed.HashStore(), "incarnation")
    for _ in range(3):
        rendezvous.done()  # the three other ranks
    service = StoppedService()
    hook._destination = Destination(None, None, service=service, ranks=4, rendezvous=rendezvous)  # type: ignore[arg-type]
    assert not rendezvous.finished(4)
    hook.close(status)
    assert service.finished == [finished] and rendezvous.finished(4)
