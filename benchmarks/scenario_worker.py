"""One rank of a detection scenario: ``python benchmarks/scenario_worker.py [faults]``.

The demo's training (``monitor.demo.worker``: a real model, DDP on gloo, the RunHealth hook)
with the faults of the detection corpus, each made the way it happens for real:

- ``--corrupt R:I``: rank R's batch I is noise (a bad shard);
- ``--nan R:S``: rank R's loss overflows to NaN at update S (and training goes on with it);
- ``--overflow S:K``: fp16-style overflow storm: a GradScaler run whose gradients are
  infinite for K windows from update S (every rank skips; the scale halves each time);
- ``--slow R:F:S``: rank R's compute takes F longer (0.1 = 10%) from update S on;
- ``--wait R:F:S[:data]``: rank R waits (sleeps, as a rank blocked on I/O or preempted does)
  F of its clean step time per update from update S on, inside its step (or in its loader);
- ``--hang R:S``: rank R stops in its forward at update S (the others wait in the all-reduce);
- ``--restart S:MODE``: at update S the job dies and restarts from its newest checkpoint,
  restoring everything (``clean``) or all but the scheduler (``lr_restart``), the data cursor
  (``cursor_reset``) or the weights (``lost_weights``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors import RunHealth
from monitor.demo.tasks import TASKS, loss_of, pair
from monitor.demo.worker import checkpoint, hook_config, restore, stream, warmup


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=sorted(TASKS), default="sequence")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0, help="data and initialisation variant")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--corrupt", default=None)
    parser.add_argument("--nan", default=None)
    parser.add_argument("--overflow", default=None)
    parser.add_argument("--slow", default=None)
    parser.add_argument("--wait", default=None)
    parser.add_argument("--hang", default=None)
    parser.add_argument("--restart", default=None)
    return parser.parse_args()


class CanaryFaults:
    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.rank = rank
        self.nan = pair(args.nan)
        self.overflow = pair(args.overflow)
        slow = args.slow.split(":") if args.slow else None
        self.slow = (int(slow[0]), float(slow[1]), int(slow[2])) if slow else None
        self.hang = pair(args.hang)
        wait = args.wait.split(":") if args.wait else None
        self.wait = (int(wait[0]), float(wait[1]), int(wait[2])) if wait else None
        self.wait_in_loader = bool(wait and wait[3:] == ["data"])
        self._ends: list[float] = []  # when each update before the wait's ended (perf_counter)

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        return loss * float("nan") if self.nan == (self.rank, step) else loss

    def overflowing(self, attempt: int) -> bool:
        """The storm's windows, counted in attempts: skipped windows do not advance the step."""
        return bool(self.overflow) and self.overflow[0] <= attempt < self.overflow[0] + self.overflow[1]

    def before_forward(self, step: int) -> None:
        if self.hang == (self.rank, step):
            time.sleep(3600)  # stuck: the runner kills the job once the hang is reported

    def waits(self, step: int) -> float:
        """Seconds to sleep at this update: ``F`` of the rank's median step before ``S``, a
        constant, so the rank is ``F`` slower than it was (its own slower steps do not feed
        back into the wait)."""
        if not self.wait or self.wait[0] != self.rank or step < self.wait[2] or len(self._ends) < 3:
            return 0.0
        return self.wait[1] * statistics.median(b - a for a, b in itertools.pairwise(self._ends))

    def ended(self, step: int) -> None:
        if self.wait and step < self.wait[2]:
            self._ends = [*self._ends[-20:], time.perf_counter()]

    def wait_in_step(self, step: int) -> None:
        if not self.wait_in_loader:
            time.sleep(self.waits(step))

    def loader(self, batches: Iterator[dict[str, Any]], step: Callable[[], int]) -> Iterator[dict[str, Any]]:
        """The loader, waiting before each batch when the wait is the loader's."""
        for batch in batches:
            if self.wait_in_loader:
                time.sleep(self.waits(step()))
            yield batch

    def stretch(self, step: int, since_cpu_s: float) -> float:
        """A slower device: each phase's work takes ``factor`` longer (spinning, not sleeping:
        a slow chip is busy, not idle). Returns the CPU clock for the next phase to start at."""
        now = time.thread_time()
        if self.slow and self.slow[0] == self.rank and step >= self.slow[2]:
            until = now + self.slow[1] * (now - since_cpu_s)
            while time.thread_time() < until:
                pass
        return time.thread_time()


def overflow_gradients(net: torch.nn.Module) -> list[Any]:
    """fp16 gradients that overflow while the loss itself stays finite, for one backward."""
    return [p.register_hook(lambda grad: grad * float("inf")) for p in net.parameters()]


def train(rank: int, args: argparse.Namespace, environ: dict[str, str]) -> None:
    task = TASKS[args.task]
    torch.manual_seed(args.seed)
    faults = CanaryFaults(args, rank)
    restart = args.restart.split(":") if args.restart else None
    net = DistributedDataParallel(task.model())
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    scheduler = warmup(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000) if args.overflow else None
    offset = args.seed * 100_000  # another slice of the same dataset for another seed
    cursor, restarted = 0, False
    with RunHealth(
        model=net,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        config=hook_config(environ, canary_on_checkpoint=False),
        environ=environ,
        run_config={"scenario": environ.get("SCENARIO", "")},
    ) as rh:
        while True:
            batches = faults.loader(
                stream(task, rank, offset + cursor, set(), None), lambda: int(rh.progress["step"] or 0) + 1
            )
            for item in rh.windows(batches, sample_ids=lambda b: b["ids"]):
                cursor = item["index"] + 1 - offset
                step = int(rh.progress["step"] or 0) + 1
                faults.before_forward(step)
                faults.wait_in_step(step)
                phase = time.thread_time()
                tokens = item["tokens"]
                if args.corrupt and pair(args.corrupt) == (rank, cursor - 1):
                    tokens = torch.randint(0, task.vocab, tokens.shape)
                loss = faults.loss(loss_of(net, tokens, task.vocab), step)
                phase = faults.stretch(step, phase)
                rh.loss(loss, labels=tokens)
                storm = scaler is not None and faults.overflowing(int(rh.progress["attempt"] or 0))
                hooks = overflow_gradients(net) if storm and rank == 0 else []  # the all-reduce spreads it
                (scaler.scale(loss) if scaler else loss).backward()  # type: ignore[no-untyped-call]
                for hook in hooks:
                    hook.remove()
                if scaler:
                    scaler.unscale_(optimizer)
                phase = faults.stretch(step, phase)
                rh.grad_norm(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0))
                if scaler:
                    scale = scaler.get_scale()
                    scaler.step(optimizer)
                    scaler.update()
                    if scaler.get_scale() >= scale:
                        scheduler.step()  # a per-update schedule does not advance on a skip
                else:
                    optimizer.step()
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                faults.stretch(step, phase)
                rh.window_end()
                faults.ended(step)
                step, consumed = int(rh.progress["step"] or 0), int(rh.progress["consumed"] or 0)
                if restart and not restarted and step == int(restart[0]):
                    break  # died between checkpoints: the steps since the last one are redone
                if step % args.checkpoint_every == 0 and not restarted:
                    checkpoint(rh, args.checkpoints / f"step-{step}", net, optimizer, scheduler, cursor)
                if step >= args.steps:
                    return
            # The job died at this step and comes back from its newest checkpoint.
            newest = max(args.checkpoints.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
            mode = restart[1] if restart else "clean"
            meta = restore(newest, net, optimizer, scheduler)
            if mode == "lr_restart":
                scheduler = warmup(optimizer)  # the scheduler state was not in the checkpoint
            if mode == "lost_weights":
                net.module.load_state_dict(task.model().state_dict())  # the weights were not restored
            cursor = 0 if mode == "cursor_reset" else meta["cursor"]
            consumed = 0 if mode == "cursor_reset" else meta["consumed"]
            rh.watch(scheduler=scheduler)
            rh.resumed(
                checkpoint_path=str(newest),
                checkpoint_step=meta["step"],
                consumed=consumed,
                scheduler=scheduler,
            )
            restarted = True


def main() -> None:
    args = arguments()
    environ = dict(os.environ)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train(dist.get_rank(), args, environ)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
