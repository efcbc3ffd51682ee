"""The example trainer for ``runhealth drill``: ``python -m monitor.demo.drill_trainer``.

A real small model (an MLP regressor), a hand-written loop with gradient accumulation, Adam, a
warm-up-then-cosine LR scheduler and a sampler with a seed and a cursor. It follows the drill
convention (``monitor/drills/convention.py``): it takes ``--steps`` (train until this many
updates, then save and exit), ``--checkpoint-dir`` and ``--resume-from``; every checkpoint is a
new directory ``step-<N>`` (a PyTorch Distributed Checkpoint of the model and optimizer state,
``trainer-state.json`` with the step, consumed examples, learning rates, scheduler state and
timings, and one ``data-rank<R>.json`` per rank with the sample ids it reads next), published
by atomically replacing the ``latest`` pointer once every rank's files are written; the older
ones beyond the last two are deleted after that.

Under ``torchrun`` the model is sharded with FSDP2 over gloo; the global batch stays the same
whatever the world size (the per-rank microbatch is divided), so a 2-rank run and a 4-rank
run take the same updates. SIGTERM sets a flag (never saves from the handler); the loop saves
at the next completed update and exits. With ``RUNHEALTH_URL`` set the runhealth hook is
attached, as the README's hand-written loop recipe does.

``--broken``: the resume restarts its scheduler and drops the optimizer state (it restores
the weights and the data cursor only): the variant the drills must catch.

Imports torch: it is the trainer side, run as its own process, never imported by the service.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from monitor.demo.process_exit import exit_without_teardown

DATASET_SIZE = 4096
FEATURES = 16
KEEP_CHECKPOINTS = 2  # the drills read the last two (the next gradient update)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="train until this many updates, then save")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--resume-from", type=Path, default=None, help="step-N, or a checkpoint dir (latest)")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N updates")
    parser.add_argument("--global-batch", type=int, default=96, help="examples per update, all ranks")
    parser.add_argument("--accumulation", type=int, default=2, help="microbatches per update")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20, help="warm-up updates of the schedule")
    parser.add_argument("--horizon", type=int, default=200, help="updates of the cosine schedule")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--microbatch-seconds", type=float, default=0.0, help="more compute per microbatch")
    parser.add_argument("--save-stall-seconds", type=float, default=0.0, help="a slow storage write")
    parser.add_argument(
        "--nonfinite-step", type=int, default=None, help="rank 0's loss is NaN at this update"
    )
    parser.add_argument("--straggler-rank", type=int, default=None)
    parser.add_argument("--straggler-seconds", type=float, default=0.0, help="its extra compute per window")
    parser.add_argument("--broken", action="store_true", help="restart the scheduler, drop optimizer state")
    return parser.parse_args(argv)


class Sampler:
    """A seeded permutation per epoch and a global cursor (examples consumed by all ranks).
    Each window takes the next ``global_batch`` positions; rank r reads every world-th of them,
    so the data partition follows the cursor, not the world size."""

    def __init__(self, seed: int, size: int) -> None:
        self.seed, self.size, self.cursor = seed, size, 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: [int(i) for i in torch.randperm(self.size, generator=generator)]}
        return self._orders[epoch]

    def window_ids(self, global_batch: int, cursor: int | None = None) -> list[int]:
        start = self.cursor if cursor is None else cursor
        epoch, offset = divmod(start, self.size)
        order = self._order(epoch)
        ids = order[offset : offset + global_batch]
        if len(ids) < global_batch:
            ids += self._order(epoch + 1)[: global_batch - len(ids)]
        return ids

    def rank_ids(self, global_batch: int, rank: int, world: int) -> list[int]:
        return self.window_ids(global_batch)[rank::world]


class Dataset:
    """Fixed examples: example i's features and target depend on the seed alone, so any rank
    can read any id."""

    def __init__(self, size: int) -> None:
        self.x = torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(10_000))
        self.y = torch.sin(self.x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * self.x[:, 4:5]

    def __getitem__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(ids)
        return self.x[index], self.y[index]


def build(args: argparse.Namespace, world: int) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 1),
    )
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    warmup, horizon = int(args.warmup), int(args.horizon)

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (update - warmup) / max(1, horizon - warmup))))

    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Checkpoints:
    """New directory per save, published by replacing ``latest`` atomically after every rank
    wrote its part; the previous one is kept until then (a save cut short is never selected)."""

    def __init__(self, root: Path, rank: int, world: int, stall_s: float) -> None:
        self.root, self.rank, self.world, self.stall_s = root, rank, world, stall_s
        root.mkdir(parents=True, exist_ok=True)

    def resolve(self, path: Path) -> Path:
        pointer = path / "latest"
        if pointer.exists():
            return path / pointer.read_text().strip()
        if (path / "trainer-state.json").exists():
            return path
        raise SystemExit(f"no published checkpoint at {path}")

    def save(self, model: Any, optimizer: Any, state: dict[str, Any], next_ids: list[int]) -> float:
        started = time.monotonic()
        path = self.root / f"step-{state['step']}"
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))
        write_json(
            path / f"data-rank{self.rank}.json",
            {"rank": self.rank, "world_size": self.world, "next_sample_ids": next_ids},
        )
        if self.rank == 0:
            write_json(path / "trainer-state.json", state)
        if self.stall_s > 0:
            time.sleep(self.stall_s)  # the storage write still in flight: nothing published yet
        barrier(self.world)
        if self.rank == 0:
            self._publish(path)
        barrier(self.world)
        return time.monotonic() - started

    def _publish(self, path: Path) -> None:
        pointer = self.root / "latest.tmp"
        pointer.write_text(path.name)
        with open(pointer) as handle:
            os.fsync(handle.fileno())
        os.replace(pointer, self.root / "latest")
        steps = sorted(
            int(p.name.split("-")[1]) for p in self.root.glob("step-*") if p.name.split("-")[1].isdigit()
        )
        published = int(path.name.split("-")[1])
        for old in [s for s in steps if s < published][: -(KEEP_CHECKPOINTS - 1) or None]:
            shutil.rmtree(self.root / f"step-{old}", ignore_errors=True)


def write_json(path: Path, document: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(document))
    os.replace(temporary, path)


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def agreed(flag: bool, world: int) -> bool:
    """Any rank's flag, on every rank: all ranks leave the loop at the same update."""
    if world == 1:
        return flag
    value = torch.tensor([1 if flag else 0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def restore(
    args: argparse.Namespace, model: Any, optimizer: Any, scheduler: Any, path: Path
) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((path / "trainer-state.json").read_text())
    if args.broken:  # weights and the data cursor only: a fresh optimizer and a schedule from 0
        weights: dict[str, Any] = {"model": get_model_state_dict(model)}
        dcp_load(weights, checkpoint_id=str(path))
        set_model_state_dict(model, weights["model"])
        return state
    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    dcp_load(loaded, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state


class Stop:
    """SIGTERM only sets a flag; the loop saves at the next completed update."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, _signum: int, _frame: Any) -> None:
        self.requested = True


def hook(model: Any, optimizer: Any, scheduler: Any) -> Any:
    if not os.environ.get("RUNHEALTH_URL"):
        return None
    from collectors import RunHealth

    return RunHealth(model=model, optimizer=optimizer, scheduler=scheduler).start()


def compute(seconds: float) -> None:
    """Stands for more compute: the thread is busy (not asleep) this long, as on a device that
    computes slower; a sleep would not show in the CPU time the hook times a CPU rank by."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def microbatches(ids: list[int], count: int) -> Iterator[list[int]]:
    size = len(ids) // count
    for index in range(count):
        yield ids[index * size : (index + 1) * size]


def train(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    if args.global_batch % (world * args.accumulation):
        raise SystemExit(
            f"--global-batch {args.global_batch} is not a multiple of {world} ranks x {args.accumulation}"
        )
    model, optimizer, scheduler = build(args, world)
    sampler, dataset, stop = Sampler(args.seed, DATASET_SIZE), Dataset(DATASET_SIZE), Stop()
    checkpoints = Checkpoints(args.checkpoint_dir, rank, world, args.save_stall_seconds)
    step, resumed_from, save_s, saved_at = 0, None, None, -1
    window_s: list[float] = []
    if args.resume_from is not None:
        state = restore(args, model, optimizer, scheduler, checkpoints.resolve(args.resume_from))
        step, sampler.cursor, resumed_from = state["step"], state["consumed"], state["step"]
    rh = hook(model, optimizer, scheduler)
    if rh is not None and resumed_from is not None:
        rh.resumed(checkpoint_path=str(args.resume_from), checkpoint_step=step, consumed=sampler.cursor)

    def save() -> float:
        state = {
            "step": step, "consumed": sampler.cursor, "examples_per_update": args.global_batch,
            "world_size": world, "lr": scheduler.get_last_lr(), "scheduler": scheduler.state_dict(),
            "resumed_from": resumed_from, "window_seconds": window_s[-50:], "save_seconds": save_s,
        }  # fmt: skip
        took = checkpoints.save(model, optimizer, state, sampler.rank_ids(args.global_batch, rank, world))
        if rh is not None:
            rh.checkpoint_saved(step, str(checkpoints.root / f"step-{step}"), consumed=sampler.cursor)
        return took

    while step < args.steps and not agreed(stop.requested, world):
        started = time.monotonic()
        ids = sampler.rank_ids(args.global_batch, rank, world)
        if rh is not None:
            rh.window_start(sample_ids=ids)
        for index, part in enumerate(microbatches(ids, args.accumulation)):
            x, y = dataset[part]
            # a sum over this rank's examples x world / global batch: FSDP averages the ranks'
            # gradients, so the update is the global mean's whatever the world size
            prediction = model(x)
            slow = args.straggler_seconds if args.straggler_rank == rank and index == 0 else 0.0
            compute(args.microbatch_seconds + slow)  # in the forward: a slow device computes longer
            loss_sum = (prediction - y).pow(2).sum()
            if args.nonfinite_step == step + 1 and rank == 0 and resumed_from is None:
                loss_sum = loss_sum * float("nan")  # the injected nonfinite batch, first run only
            if rh is not None:
                rh.loss(loss_sum, tokens=len(part), reduction="sum")
            (loss_sum * world / args.global_batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        if rh is not None:
            rh.grad_norm(norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step, sampler.cursor = step + 1, sampler.cursor + args.global_batch
        if rh is not None:
            rh.window_end()
        window_s.append(time.monotonic() - started)
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            save_s, saved_at = save(), step
    if saved_at != step:  # the last update, or the one SIGTERM stopped at: a completed boundary
        save()
    if rh is not None:
        rh.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    # a single process saves its checkpoint with DCP too (one reader for every world size)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    train(arguments(argv))


if __name__ == "__main__":
    main()
    exit_without_teardown()  # the last save is published and every rank is past the barrier
