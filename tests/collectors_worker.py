"""One rank of the multi-rank collector tests, run as ``python -m tests.collectors_worker``.

A small DDP model on gloo with the hook attached the way a trainer would attach it; the
environment is a torchrun-like one (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``) plus
``RUNHEALTH_*``. At ``--skip-at`` the loss is made infinite so every rank's GradScaler skips the
update. Writes the hook's counters and identity to ``--out/rank-N.json`` after closing.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from collectors import RunHealth, RunHealthConfig
from monitor.demo.process_exit import exit_without_teardown
from monitor.demo.worker import run_rank

VOCAB = 64


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--skip-at", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--until-file", type=Path, default=None,
        help="after --windows, train on until this file exists (the ranks agree on the window)",
    )  # fmt: skip
    return parser.parse_args()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, VOCAB)
    )


def batches(rank: int, count: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [
        {"tokens": torch.randint(0, VOCAB, (4, 17), generator=generator),
         "ids": [f"r{rank}-{index}-{row}" for row in range(4)]}
        for index in range(count)
    ]  # fmt: skip


def until(rank: int, count: int, stop: Path) -> Iterator[dict[str, Any]]:
    """``count`` batches, then more until ``stop`` exists: the test ends the run on an event it
    waits for (a wall-clock deadline), not after a number of steps a loaded machine may not
    reach in time. Every rank asks at the same point of every window, so they stop together."""
    index = 0
    while True:
        if index >= count:
            seen = torch.tensor([1 if stop.exists() else 0])
            torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
            if seen.item():
                return
        generator = torch.Generator().manual_seed(1000 * (index + 1) + rank)
        tokens = torch.randint(0, VOCAB, (4, 17), generator=generator)
        yield {"tokens": tokens, "ids": [f"r{rank}-{index}-{row}" for row in range(4)]}
        index += 1


def hook_config(environ: dict[str, str]) -> RunHealthConfig:
    config = RunHealthConfig.from_environ(environ)
    sender = dataclasses.replace(
        config.sender, flush_interval_s=0.1, heartbeat_interval_s=0.5, retry_initial_s=0.1, retry_max_s=0.5
    )
    return dataclasses.replace(config, sender=sender)


def train(rank: int, args: argparse.Namespace, environ: dict[str, str]) -> dict[str, Any]:
    net = DistributedDataParallel(model())
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with RunHealth(
        model=net, optimizer=optimizer, scaler=scaler, config=hook_config(environ), environ=environ,
        run_config={"windows": args.windows},
    ) as rh:  # fmt: skip
        source = (
            batches(rank, args.windows)
            if args.until_file is None
            else until(rank, args.windows, args.until_file)
        )
        for index, batch in enumerate(rh.windows(source, sample_ids=lambda b: b["ids"])):
            tokens = batch["tokens"]
            logits = net(tokens)[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            if index + 1 == args.skip_at and rank == 0:
                loss = loss * float("inf")  # DDP's all-reduce spreads the inf to every rank
            rh.loss(loss, labels=tokens)
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            scaler.unscale_(optimizer)
            rh.grad_norm(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            time.sleep(args.step_sleep)
    return {
        "rank": rank,
        "counters": rh.counters,
        "progress": rh.progress,
        "incarnation": rh.incarnation,
        "run": rh.run,
        "embedded_pid": rh.embedded_pid,
        "spool_path": rh.spool_path,
    }


def main() -> None:
    run_rank(train, arguments())


if __name__ == "__main__":
    main()
    exit_without_teardown()  # the hook's ``with`` block closed it; the result is written
