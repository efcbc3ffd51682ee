"""Windows without an update merged into the next (``collectors/accumulation.py``): a loop that
opens a window per microbatch and updates every K-th is recorded one window per update, while a
skipped update (a GradScaler's, or the trainer's own) is still recorded as one."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.adapters_support import DirectingTransport, directed_hook, wait_until_armed
from tests.collectors_support import FakeMarker, RecordingTransport, wait_until
from tests.support import free_port, require_module

require_module("torch")  # before the import: skipped without torch, failed in CI

import torch  # noqa: E402

from collectors.ring import PinnedRing, RingConfig  # noqa: E402
from tests.test_collectors_hook import (  # noqa: E402
    VOCAB,
    TinyLM,
    as_device_rank,
    attach,
    lm_loss,
    tensors_as_device_tensors,
)

TOKENS = 14  # supervised tokens of a (2, 8) batch, shifted


@pytest.fixture
def transport() -> RecordingTransport:
    return RecordingTransport()


def microbatch_loop(
    rh: Any,
    model: TinyLM,
    optimizer: torch.optim.Optimizer,
    count: int,
    update_every: int,
    scaler: torch.amp.GradScaler | None = None,
    inf_every_window: bool = False,
) -> list[float]:
    """A ``no_trainer``-style loop attached the hurried way: a window around each microbatch,
    the optimizer stepped every ``update_every``-th, gradients zeroed after it. Returns each
    microbatch's loss."""
    losses = []
    generator = torch.Generator().manual_seed(0)
    for index in range(count):
        rh.window_start(sample_ids=[index])
        loss = lm_loss(model, torch.randint(0, VOCAB, (2, 8), generator=generator))
        losses.append(loss.detach().item())
        rh.loss(loss, tokens=TOKENS)
        (scaler.scale(loss) if scaler is not None else loss).backward()  # type: ignore[no-untyped-call]
        boundary = index % update_every == update_every - 1
        if scaler is None and boundary:
            optimizer.step()
        elif scaler is not None and (boundary or inf_every_window):
            if inf_every_window and not boundary:
                for parameter in model.parameters():
                    assert parameter.grad is not None
                    parameter.grad.fill_(math.inf)
            scaler.step(optimizer)
            scaler.update()
        if boundary or inf_every_window:
            optimizer.zero_grad()
        rh.window_end()
    return losses


def forward_and_backward(rh: Any, model: TinyLM, generator: torch.Generator) -> None:
    loss = lm_loss(model, torch.randint(0, VOCAB, (2, 8), generator=generator))
    rh.loss(loss, tokens=TOKENS)
    loss.backward()  # type: ignore[no-untyped-call]


def sgd(model: TinyLM) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


@contextlib.contextmanager
def sgd_run(
    tmp_path: Path, transport: RecordingTransport, seed: int
) -> Iterator[tuple[Any, TinyLM, torch.optim.Optimizer, torch.Generator]]:
    """An attached hook watching a model and its SGD optimizer, and a seeded batch generator."""
    model = TinyLM()
    optimizer = sgd(model)
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        yield rh, model, optimizer, torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("with_scaler", [False, True], ids=["plain", "grad_scaler"])
def test_a_window_per_microbatch_of_an_accumulating_loop_is_one_window_per_update(
    tmp_path: Path, transport: RecordingTransport, caplog: pytest.LogCaptureFixture, with_scaler: bool
) -> None:
    """Twelve microbatches, an update every fourth: three windows of four microbatches each,
    none skipped, with the four losses, token counts, ids and data waits of each, and the
    attempt and step counters of three optimizer-step attempts. Nothing is said to fix."""
    model = TinyLM()
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler("cpu") if with_scaler else None
    caplog.set_level(logging.INFO, logger="runhealth.collectors")
    with attach(tmp_path, transport, model=model, optimizer=optimizer, scaler=scaler) as rh:
        losses = microbatch_loop(rh, model, optimizer, 12, update_every=4, scaler=scaler)
    steps = transport.records("step")
    assert [(s["attempt"], s["step"], s["skipped"], s["microbatches"]) for s in steps] == [
        (1, 1, False, 4),
        (2, 2, False, 4),
        (3, 3, False, 4),
    ]
    for number, step in enumerate(steps):
        four = losses[4 * number : 4 * number + 4]
        assert step["tokens"] == 4 * TOKENS
        assert step["loss_sum"] == pytest.approx(TOKENS * sum(four), rel=1e-6)
        assert step["sample_ids"] == list(range(4 * number, 4 * number + 4))
        assert step["consumed"] == 4 * (number + 1)
        assert step["data_wait_s"] >= 0.0
    assert "and nothing skipped one" not in caplog.text  # the note on attaching such a loop
    assert caplog.text.count("is merged into the next one") == 1


def test_a_grad_scaler_that_skips_in_every_window_is_still_recorded_skipping(
    tmp_path: Path, transport: RecordingTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """The scaler steps and updates in every window and finds inf gradients in three of four:
    those are its skips, each its own window (the skip-storm rule's evidence), and nothing is
    merged or said."""
    model = TinyLM()
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler("cpu")
    caplog.set_level(logging.INFO, logger="runhealth.collectors")
    with attach(tmp_path, transport, model=model, optimizer=optimizer, scaler=scaler) as rh:
        microbatch_loop(rh, model, optimizer, 12, update_every=4, scaler=scaler, inf_every_window=True)
    steps = transport.records("step")
    assert [s["skipped"] for s in steps] == [True, True, True, False] * 3
    assert {s["microbatches"] for s in steps} == {1}
    assert "and nothing skipped one" not in caplog.text and "merged" not in caplog.text


TrainerGuard = Callable[[Any, torch.optim.Optimizer], None]


def zero_before_the_window_ends(rh: Any, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()  # the guard drops the gradients at once: nothing is held
    rh.window_end()


def zero_after_the_window_ends(rh: Any, optimizer: torch.optim.Optimizer) -> None:
    rh.window_end()
    optimizer.zero_grad()  # held, then found zeroed when the next window starts


def norm_given(rh: Any, optimizer: torch.optim.Optimizer) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rh.grad_norm(torch.nn.utils.clip_grad_norm_(params, 1.0))  # the guard looked at the norm
    rh.window_end()  # its gradients are zeroed only after the next window starts


@pytest.mark.parametrize("guard", [zero_before_the_window_ends, zero_after_the_window_ends, norm_given])
def test_an_update_the_trainer_skips_on_its_own_is_still_a_skip(
    tmp_path: Path, transport: RecordingTransport, guard: TrainerGuard
) -> None:
    """A loop that skips an update by not stepping (a loss or norm guard): the window had a
    backward but is not accumulating: its gradients were zeroed before the next window began,
    or the trainer gave the norm it guarded on. Either way it is recorded as a skip."""
    with sgd_run(tmp_path, transport, seed=1) as (rh, model, optimizer, generator):
        for index in range(4):
            rh.window_start()
            optimizer.zero_grad()  # at the top of the iteration, as many loops do
            forward_and_backward(rh, model, generator)
            if index == 1:
                guard(rh, optimizer)
                continue
            optimizer.step()
            rh.window_end()
    steps = transport.records("step")
    assert [(s["step"], s["skipped"], s["microbatches"]) for s in steps] == [
        (1, False, 1),
        (1, True, 1),
        (2, False, 1),
        (3, False, 1),
    ]


def test_a_window_without_a_backward_is_not_held(tmp_path: Path, transport: RecordingTransport) -> None:
    """No gradient (an evaluation batch inside a window, a loss guard before the backward):
    nothing accumulates, so the window is its own record."""
    model = TinyLM()
    optimizer = sgd(model)
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        for _ in range(2):
            rh.window_start()
            with torch.no_grad():
                rh.loss(lm_loss(model, torch.randint(0, VOCAB, (2, 8))), tokens=TOKENS)
            rh.window_end()
    assert [(s["skipped"], s["microbatches"]) for s in transport.records("step")] == [(True, 1)] * 2


def test_a_step_after_the_window_ended_is_the_held_windows_update(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """``rh.window_end()`` written after the backward, before ``optimizer.step()`` and the save
    after it: the step's hooks find the held window, which then closes as that update, and the
    save records the examples that update consumed."""
    with sgd_run(tmp_path, transport, seed=2) as (rh, model, optimizer, generator):
        for index in range(6):
            rh.window_start(sample_ids=[index])
            forward_and_backward(rh, model, generator)
            rh.window_end()
            if index % 3 == 2:
                optimizer.step()
                optimizer.zero_grad()
                (tmp_path / "ckpt.pt").write_bytes(b"w")  # overwritten in place
                rh.checkpoint_saved(index // 3 + 1, str(tmp_path / "ckpt.pt"), hash_files=False)
    steps = transport.records("step")
    assert [(s["step"], s["skipped"], s["microbatches"], s["consumed"]) for s in steps] == [
        (1, False, 3, 3),
        (2, False, 3, 6),
    ]
    assert [(c["step"], c["consumed"]) for c in transport.records("checkpoint")] == [(1, 3), (2, 6)]


def test_a_grad_scaler_skip_after_the_window_ended_is_still_a_skip(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """``rh.window_end()`` before ``scaler.step``, gradients zeroed at the top of each
    accumulation: the first update's gradients overflow, the scaler skips it and backs off
    (``update()``), and the held window is recorded as that skip, not merged into the next."""
    model = TinyLM()
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(4)
    with attach(tmp_path, transport, model=model, optimizer=optimizer, scaler=scaler) as rh:
        for index in range(8):
            rh.window_start()
            if index % 4 == 0:
                optimizer.zero_grad()
            loss = lm_loss(model, torch.randint(0, VOCAB, (2, 8), generator=generator))
            rh.loss(loss, tokens=TOKENS)
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            rh.window_end()
            if index % 4 == 3:
                if index == 3:
                    for parameter in model.parameters():
                        assert parameter.grad is not None
                        parameter.grad.fill_(math.inf)
                scaler.step(optimizer)
                scaler.update()
    steps = transport.records("step")
    assert [(s["step"], s["skipped"], s["microbatches"]) for s in steps] == [(0, True, 4), (1, False, 4)]


def test_a_held_window_is_recorded_at_close_as_the_update_it_did_not_reach(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    """Six microbatches, an update every fourth: the last two never reach an update, and the
    hook's close records them as one skipped window with both losses."""
    model = TinyLM()
    optimizer = sgd(model)
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        losses = microbatch_loop(rh, model, optimizer, 6, update_every=4)
    steps = transport.records("step")
    assert [(s["attempt"], s["step"], s["skipped"], s["microbatches"]) for s in steps] == [
        (1, 1, False, 4),
        (2, 1, True, 2),
    ]
    assert steps[1]["loss_sum"] == pytest.approx(TOKENS * sum(losses[4:]), rel=1e-6)
    assert steps[1]["sample_ids"] == [4, 5]


def test_a_loop_that_never_updates_still_gets_a_record_every_max_parts_windows(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("collectors.accounting.MAX_PARTS", 3)
    model = TinyLM()
    optimizer = sgd(model)
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        microbatch_loop(rh, model, optimizer, 7, update_every=100)
        assert wait_until(lambda: len(transport.records("step")) == 2, 5.0)
    steps = transport.records("step")
    assert [(s["attempt"], s["skipped"], s["microbatches"]) for s in steps] == [
        (1, True, 3),
        (2, True, 3),
        (3, True, 1),
    ]


def test_a_rollback_stop_records_the_held_window_before_the_restore(tmp_path: Path) -> None:
    """The rollback at step 2 stops the loop in the next accumulation (every rank at the same
    window): the microbatch held there is recorded at the stop, in this timeline, not at a
    later close."""
    transport = DirectingTransport()
    rh = directed_hook(transport, tmp_path)
    model = TinyLM()
    optimizer = sgd(model)
    rh.watch(model=model, optimizer=optimizer)
    generator = torch.Generator().manual_seed(3)
    stopped_at = None
    with rh:
        wait_until_armed(transport)
        for index in range(12):
            if rh.should_stop():
                stopped_at = index
                break
            rh.window_start()
            forward_and_backward(rh, model, generator)
            if index % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
            rh.window_end()
        assert stopped_at == 5
        assert wait_until(lambda: len(transport.records("step")) == 3, 5.0)  # before the close
    steps = transport.records("step")
    assert [(s["attempt"], s["step"], s["skipped"], s["microbatches"]) for s in steps] == [
        (1, 1, False, 2),
        (2, 2, False, 2),
        (3, 2, True, 1),
    ]


def test_held_device_windows_travel_through_the_ring_as_one(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an accelerator the merged window's losses are summed on the device and cross in one
    ring slot (the device faked as in ``test_collectors_hook``)."""
    tensors_as_device_tensors(monkeypatch)
    model = TinyLM()
    optimizer = sgd(model)
    with attach(tmp_path, transport, model=model, optimizer=optimizer) as rh:
        as_device_rank(rh)
        rh._windows._ring = PinnedRing(RingConfig(), device=torch.device("cpu"), new_marker=FakeMarker)
        losses = microbatch_loop(rh, model, optimizer, 6, update_every=3)
    steps = transport.records("step")
    assert [(s["step"], s["skipped"], s["microbatches"], s["tokens"]) for s in steps] == [
        (1, False, 3, 3 * TOKENS),
        (2, False, 3, 3 * TOKENS),
    ]
    assert [s["loss_sum"] for s in steps] == pytest.approx(
        [TOKENS * sum(losses[:3]), TOKENS * sum(losses[3:])], rel=1e-6
    )


def wrapped(kind: str, model: TinyLM) -> torch.nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    return torch.nn.parallel.DistributedDataParallel(model)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # a linear layer's 3-d output is a view
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_data_parallel_wrappers_on_a_one_rank_gloo_group(
    tmp_path: Path, transport: RecordingTransport, kind: str
) -> None:
    """The gradient a wrapper leaves after each backward (no ``no_sync``): DDP accumulates into
    the same tensor, and so does FSDP2 into its sharded DTensor gradient, so their windows
    merge. (One rank here; two ranks with gradient bucket views below.)"""
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = TinyLM()
        module = wrapped(kind, model)
        optimizer = sgd(model)
        with attach(tmp_path, transport, model=module, optimizer=optimizer) as rh:
            microbatch_loop(rh, module, optimizer, 6, update_every=3)  # type: ignore[arg-type]
    finally:
        torch.distributed.destroy_process_group()
    assert [(s["skipped"], s["microbatches"]) for s in transport.records("step")] == [(False, 3)] * 2


BUCKET_RANKS = 2


def bucket_view_rank(rank: int, port: int, root: str) -> None:
    """One rank of ``test_ddp_gradient_bucket_views_on_two_gloo_ranks``: the hurried loop under
    DDP with ``gradient_as_bucket_view=True`` and one-parameter buckets, once with ``no_sync``
    on the microbatches that do not update and once syncing every backward; each loop's
    ``(skipped, microbatches)`` per window written to ``root/rank-R-MODE.json``."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=BUCKET_RANKS
    )
    try:
        for mode in ("no_sync", "sync"):
            torch.manual_seed(0)
            model = TinyLM()
            module = torch.nn.parallel.DistributedDataParallel(
                model, gradient_as_bucket_view=True, bucket_cap_mb=0.001
            )
            optimizer = sgd(model)
            transport = RecordingTransport()
            generator = torch.Generator().manual_seed(rank)
            folder = Path(root) / f"rank-{rank}-{mode}"
            folder.mkdir()
            with attach(folder, transport, model=module, optimizer=optimizer) as rh:
                for index in range(8):
                    boundary = index % 4 == 3
                    quiet = (
                        module.no_sync() if mode == "no_sync" and not boundary else contextlib.nullcontext()
                    )
                    rh.window_start(sample_ids=[index])
                    with quiet:
                        loss = lm_loss(module, torch.randint(0, VOCAB, (2, 8), generator=generator))  # type: ignore[arg-type]
                        rh.loss(loss, tokens=TOKENS)
                        loss.backward()  # type: ignore[no-untyped-call]
                    if boundary:
                        optimizer.step()
                        optimizer.zero_grad()
                    rh.window_end()
            windows = [(s["skipped"], s["microbatches"]) for s in transport.records("step")]
            (Path(root) / f"rank-{rank}-{mode}.json").write_text(json.dumps(windows))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ddp_gradient_bucket_views_on_two_gloo_ranks(tmp_path: Path) -> None:
    """DDP with ``gradient_as_bucket_view=True`` on two real ranks: the gradient becomes a view
    into DDP's bucket, and DDP replaces those views when it rebuilds its buckets, which it does
    in the second forward. The hook compares the gradient when the next window starts, before
    that forward, so every accumulating window still merges: one window per update, with and
    without ``no_sync`` on the accumulating microbatches. (An earlier probe compared after the
    second backward instead and took the rebuild for a gradient that is not kept.)"""
    torch.multiprocessing.spawn(
        bucket_view_rank, args=(free_port(), str(tmp_path)), nprocs=BUCKET_RANKS, join=True
    )
    for rank in range(BUCKET_RANKS):
        for mode in ("no_sync", "sync"):
            windows = json.loads((tmp_path / f"rank-{rank}-{mode}.json").read_text())
            assert windows == [[False, 4], [False, 4]], (rank, mode, windows)
