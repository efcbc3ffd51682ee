"""One rank of the demo (and of the recovery tests): ``python -m monitor.demo.worker``.

A DDP model on gloo trains with the RunHealth hook, checkpoints every ``--checkpoint-every``
updates (files, manifest, data cursor), and carries out a rollback directive when the hook
stops it: restore the named checkpoint, skip the named batches, resume
(``collectors.handle_rollback``, with this worker's own restore). Canaryfaults, each as it
would happen for real:

- ``--corrupt R:I``: rank R's batch I is noise (a bad data shard: replays reproduce it);
- ``--faulty-rank R``: rank R's device computes wrong answers: its canary's GEMM output has a
  high bit flipped, and with ``--training-flips P`` its training matmuls too, with
  probability P per call (silent data corruption);
- ``--transient R:S``: rank R's loss is hit once at update S, in the first run only (a fault
  neither a replay nor a canary can explain);
- ``--nan R:S``: rank R's loss is NaN once, at update S, in the first run only (its gradients reach
  every replica through the all-reduce). ``--fused``: a fused AdamW, which can skip such an
  update on the device (``RUNHEALTH_HOOK__NONFINITE_RESPONSE=skip_update``).

Imports torch: it is the trainer side, run as its own process, never imported by the service.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from collectors import RunHealth, RunHealthConfig, build_manifest, handle_rollback
from collectors.canary import CanaryFaults
from monitor.demo.process_exit import exit_without_teardown
from monitor.demo.tasks import TASKS, Task, loss_of, pair


def bit_flipper(rng: random.Random, probability: float, bit: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A marginal core: with ``probability`` per call, one element gets one exponent bit flipped.
    The wrong value flows on as if computed, so gradients still reach every parameter."""

    def flip(tensor: torch.Tensor) -> torch.Tensor:
        if rng.random() >= probability:
            return tensor
        flat = tensor.detach().clone().contiguous().view(-1).view(torch.int32)
        flat[rng.randrange(flat.numel())] ^= 1 << bit
        return tensor + (flat.view(torch.float32).view(tensor.shape) - tensor).detach()

    return flip


def stream(
    task: Task, rank: int, cursor: int, skip: set[str], corrupt: tuple[int, int] | None
) -> Iterator[dict[str, Any]]:
    index = cursor
    while True:
        item = task.batch(rank, index, corrupt)
        if item["ids"][0] not in skip:
            yield item
        index += 1


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=sorted(TASKS), default="sequence")
    parser.add_argument("--steps", type=int, default=80, help="updates before the run may end")
    parser.add_argument("--after-rollback", type=int, default=20, help="updates after a rollback")
    parser.add_argument("--max-steps", type=int, default=400, help="end anyway after this many updates")
    parser.add_argument(
        "--wait-rollback",
        action="store_true",
        help="keep training until a rollback came (or --wait-rollback-s passed), whatever --max-steps says",
    )
    parser.add_argument("--wait-rollback-s", type=float, default=600.0, help="wall-clock bound on that wait")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--corrupt", default=None, help="R:I")
    parser.add_argument("--faulty-rank", type=int, default=None)
    parser.add_argument("--training-flips", type=float, default=0.0)
    parser.add_argument("--faulty-from", type=int, default=0, help="the device fails from this update on")
    parser.add_argument("--transient", default=None, help="R:S")
    parser.add_argument("--nan", default=None, help="R:S")
    parser.add_argument("--fused", action="store_true", help="a fused AdamW (skips on a device flag)")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--replay-command", default=None)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def save(path: Path, net: torch.nn.Module, optimizer: Any, scheduler: Any, meta: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), path / "model.pt")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path / "optim.pt")
    (path / "meta.json").write_text(json.dumps(meta))


def checkpoint(
    rh: RunHealth, path: Path, net: torch.nn.Module, optimizer: Any, scheduler: Any, cursor: int
) -> None:
    """Every rank calls this at the same step: rank 0 writes (DDP replicas are equal), all wait
    for it, and each reports the checkpoint so the service knows every rank reached it."""
    step, consumed = int(rh.progress["step"] or 0), int(rh.progress["consumed"] or 0)
    if dist.get_rank() == 0:
        save(path, net, optimizer, scheduler, {"step": step, "cursor": cursor, "consumed": consumed})
    dist.barrier()
    rh.checkpoint_saved(step, str(path), manifest=build_manifest(str(path), step, consumed))


def restore(path: Path, net: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    net.load_state_dict(torch.load(path / "model.pt"))
    states = torch.load(path / "optim.pt")
    optimizer.load_state_dict(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    meta: dict[str, Any] = json.loads((path / "meta.json").read_text())
    return meta


def agreed_past(deadline: float) -> bool:
    """Whether any rank is past ``deadline``. Ranks leave the loop at one step or the others wait
    in their next collective forever, so the wall clock is agreed, not read rank by rank."""
    late = torch.tensor([1 if time.monotonic() > deadline else 0])
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def warmup(optimizer: Any) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))


def hook_config(environ: dict[str, str], canary_on_checkpoint: bool) -> RunHealthConfig:
    """Quick pacing for a short run: records every 0.1 s, directives polled every 0.2 s."""
    config = RunHealthConfig.from_environ(environ)
    sender = dataclasses.replace(
        config.sender, flush_interval_s=0.1, heartbeat_interval_s=0.5, retry_initial_s=0.1, retry_max_s=0.5
    )
    directives = dataclasses.replace(config.directives, poll_interval_s=0.2)
    hook = dataclasses.replace(config.hook, agree_every=2, canary_on_checkpoint=canary_on_checkpoint)
    return dataclasses.replace(config, sender=sender, directives=directives, hook=hook)


def train(rank: int, args: argparse.Namespace, environ: dict[str, str]) -> dict[str, Any]:
    task = TASKS[args.task]
    corrupt, transient, nan = pair(args.corrupt), pair(args.transient), pair(args.nan)
    faulty = args.faulty_rank == rank
    net = DistributedDataParallel(task.model())
    if faulty and args.training_flips > 0:
        flip = bit_flipper(random.Random(7), args.training_flips, bit=27)  # x or / 2**16: a survivable spike
        for module in net.module.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda _m, _i, out: flip(out))
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, fused=args.fused or None)
    scheduler = warmup(optimizer)
    corrupt_gemm = bit_flipper(random.Random(11), 1.0, bit=30)
    now = {"step": 0}  # the device degrades at --faulty-from: its canaries fail from then on

    def canary_output(kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        return corrupt_gemm(tensor) if kernel == "gemm_fp32" and now["step"] >= args.faulty_from else tensor

    canary_faults = CanaryFaults(output=canary_output)
    config = hook_config(environ, canary_on_checkpoint=args.faulty_rank is not None)
    run_config = (
        {"task": args.task, "replay_command": args.replay_command}
        if args.replay_command
        else {"task": args.task}
    )
    cursor, resumed_at = 0, None
    # A loaded machine replays and approves slower than it trains: the wait for a rollback is
    # bounded by time, never by a step count.
    wait_deadline = time.monotonic() + args.wait_rollback_s
    skip: set[str] = set()
    rollbacks: list[dict[str, Any]] = []
    nan_hit = False
    with RunHealth(
        model=net,
        optimizer=optimizer,
        scheduler=scheduler,
        config=config,
        environ=environ,
        run_config=run_config,
        canary_faults=canary_faults if faulty else None,
    ) as rh:
        while True:
            for item in rh.windows(stream(task, rank, cursor, skip, corrupt), sample_ids=lambda b: b["ids"]):
                cursor = item["index"] + 1
                loss = loss_of(net, item["tokens"], task.vocab)
                if transient == (rank, int(rh.progress["step"] or 0) + 1) and not rollbacks:
                    loss = loss * 40.0
                if nan == (rank, int(rh.progress["step"] or 0) + 1) and not rollbacks and not nan_hit:
                    loss, nan_hit = loss * float("nan"), True  # once: a skipped update keeps the step
                rh.loss(loss, labels=item["tokens"])
                loss.backward()  # type: ignore[no-untyped-call]
                rh.grad_norm(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                time.sleep(args.step_sleep)
                rh.window_end()  # the window's update counted now, so the checkpoint's step is right
                step = int(rh.progress["step"] or 0)
                now["step"] = step
                if step % args.checkpoint_every == 0:
                    checkpoint(
                        rh,
                        args.checkpoints / f"step-{step}-{len(rollbacks)}",
                        net,
                        optimizer,
                        scheduler,
                        cursor,
                    )
                if resumed_at is not None:
                    if step >= resumed_at + args.after_rollback or step >= args.max_steps:
                        break
                elif args.wait_rollback:
                    if step % 10 == 0 and agreed_past(wait_deadline):
                        break
                elif step >= args.steps or step >= args.max_steps:
                    break
            # The incarnation that ends here and its windows, if a rollback restores (a restore
            # starts a new one).
            ending: dict[str, Any] = {
                "stopped_at": rh.progress["step"],
                "incarnation": rh.incarnation,
                "attempts": rh.progress["attempt"],
            }
            rollback = handle_rollback(
                rh,
                load=lambda path: restore(Path(path), net, optimizer, scheduler),
                # Batch i of rank r is the same every time (tasks.py): the ids after it are checked.
                resume=lambda meta: {"consumed": meta["consumed"], "deterministic_data": True},
            )
            if rollback is None:
                break
            meta = rollback.loaded
            cursor, skip = meta["cursor"], skip | rollback.skip
            rollbacks.append({"directive": rollback.directive, "to": meta["step"], **ending})
            resumed_at = meta["step"]
    return {
        "rank": rank,
        "rollbacks": rollbacks,
        "progress": rh.progress,
        "incarnation": rh.incarnation,
        "counters": rh.counters,
        "skip": sorted(skip),
        "readers": rh.readers,
    }


def run_rank(
    train: Callable[[int, argparse.Namespace, dict[str, str]], dict[str, Any]], args: argparse.Namespace
) -> None:
    """One rank of a gloo job started as torchrun would: ``train`` runs in the process group,
    and what it returns lands in ``args.out/rank-N.json``."""
    logging.basicConfig(level=logging.WARNING, format=f"rank {os.environ.get('RANK')}: %(message)s")
    environ = dict(os.environ)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = train(rank, args, environ)
    finally:
        dist.destroy_process_group()
    (args.out / f"rank-{rank}.json").write_text(json.dumps(result))


def main() -> None:
    run_rank(train, arguments())


if __name__ == "__main__":
    main()
    exit_without_teardown()
