"""One rank of the recovery end-to-end tests, run as ``python -m tests.recovery_worker``.

A small DDP model on gloo learns a sequence task (each token is the previous plus one, with 10%
label noise), checkpoints every ``--checkpoint-every`` updates (files, manifest, cursor), and
carries out a rollback directive when the hook stops it: restore the named checkpoint, skip the
named batches, resume. Faults, each as it would happen for real:

- ``--corrupt R:I``: rank R's batch I is noise (a bad data shard: replays reproduce it);
- ``--faulty-rank R``: rank R's device flips a high bit in a matmul output now and then, and
  its canary's GEMM output too (silent data corruption: replays elsewhere do not reproduce it);
- ``--transient R:S``: rank R's loss is hit once at update S, in the first run only (a fault
  that neither a replay nor a canary can explain).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from collectors import RunHealth, RunHealthConfig, build_manifest
from collectors.canary import Faults

VOCAB, LENGTH, ROWS = 32, 17, 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, VOCAB)
    )


def batch(rank: int, index: int, corrupt: tuple[int, int] | None) -> dict[str, Any]:
    """Rank ``rank``'s batch ``index`` of the dataset, the same in training and in replays."""
    generator = torch.Generator().manual_seed(rank * 1_000_003 + index)
    if corrupt == (rank, index):
        tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    else:
        start = torch.randint(0, VOCAB, (ROWS, 1), generator=generator)
        tokens = (start + torch.arange(LENGTH)) % VOCAB
        noise = torch.rand(ROWS, LENGTH, generator=generator) < 0.1
        tokens = torch.where(noise, torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator), tokens)
    return {"tokens": tokens, "index": index, "ids": [f"r{rank}-b{index}"]}


def stream(
    rank: int, cursor: int, skip: set[str], corrupt: tuple[int, int] | None
) -> Iterator[dict[str, Any]]:
    index = cursor
    while True:
        item = batch(rank, index, corrupt)
        if item["ids"][0] not in skip:
            yield item
        index += 1


def loss_of(net: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = net(tokens)[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def bit_flipper(rng: random.Random, probability: float, bit: int = 30) -> Any:
    """A marginal core: with ``probability`` per call, one element gets one exponent bit flipped."""

    def flip(tensor: torch.Tensor) -> torch.Tensor:
        if rng.random() >= probability:
            return tensor
        flat = tensor.detach().clone().contiguous().view(-1).view(torch.int32)
        flat[rng.randrange(flat.numel())] ^= 1 << bit
        corrupted = flat.view(torch.float32).view(tensor.shape)
        # The wrong value flows on as if computed: gradients still reach every parameter.
        return tensor + (corrupted - tensor).detach()

    return flip


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=80, help="updates before the run may end")
    parser.add_argument("--after-rollback", type=int, default=20, help="updates after a rollback")
    parser.add_argument("--max-steps", type=int, default=400, help="end anyway after this many updates")
    parser.add_argument("--wait-rollback", action="store_true", help="keep training until a rollback came")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--corrupt", default=None, help="R:I")
    parser.add_argument("--faulty-rank", type=int, default=None)
    parser.add_argument("--transient", default=None, help="R:S")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--replay-command", default=None)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def pair(text: str | None) -> tuple[int, int] | None:
    return None if text is None else (int(text.split(":")[0]), int(text.split(":")[1]))


def save(path: Path, net: torch.nn.Module, optimizer: Any, scheduler: Any, meta: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), path / "model.pt")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path / "optim.pt")
    (path / "meta.json").write_text(json.dumps(meta))


def hook_config(environ: dict[str, str], canary_on_checkpoint: bool) -> RunHealthConfig:
    config = RunHealthConfig.from_environ(environ)
    sender = dataclasses.replace(
        config.sender, flush_interval_s=0.1, heartbeat_interval_s=0.5, retry_initial_s=0.1, retry_max_s=0.5
    )
    directives = dataclasses.replace(config.directives, poll_interval_s=0.2)
    hook = dataclasses.replace(config.hook, agree_every=2, canary_on_checkpoint=canary_on_checkpoint)
    return dataclasses.replace(config, sender=sender, directives=directives, hook=hook)


def train(rank: int, args: argparse.Namespace, environ: dict[str, str]) -> dict[str, Any]:
    corrupt, transient = pair(args.corrupt), pair(args.transient)
    faulty = args.faulty_rank == rank
    net = DistributedDataParallel(model())
    if faulty:
        # Bit 27 (x or / 2**16): a spike that training survives, unlike the overflow of bit 30.
        flip = bit_flipper(random.Random(7), 0.02, bit=27)
        net.module[1].register_forward_hook(lambda _m, _i, out: flip(out))
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    canary_faults = Faults(
        output=lambda k, t: bit_flipper(random.Random(11), 1.0)(t) if k == "gemm_fp32" else t
    )
    config = hook_config(environ, canary_on_checkpoint=args.faulty_rank is not None)
    cursor, skip, rollbacks, resumed_at = 0, set(), [], None
    with RunHealth(
        model=net,
        optimizer=optimizer,
        scheduler=scheduler,
        config=config,
        environ=environ,
        run_config={"replay_command": args.replay_command} if args.replay_command else None,
        canary_faults=canary_faults if faulty else None,
    ) as rh:
        while True:
            for item in rh.windows(stream(rank, cursor, skip, corrupt), sample_ids=lambda b: b["ids"]):
                cursor = item["index"] + 1
                loss = loss_of(net, item["tokens"])
                step = rh.progress["step"] + 1
                if transient and transient == (rank, step) and not rollbacks:
                    loss = loss * 40.0
                rh.loss(loss, labels=item["tokens"])
                loss.backward()
                rh.grad_norm(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                time.sleep(args.step_sleep)
                rh.window_end()  # the window's update counted now, so the checkpoint's step is right
                step = rh.progress["step"]
                consumed = rh.progress["consumed"]
                if step % args.checkpoint_every == 0:
                    path = args.checkpoints / f"step-{step}-{len(rollbacks)}"
                    if rank == 0:
                        save(
                            path,
                            net,
                            optimizer,
                            scheduler,
                            {"step": step, "cursor": cursor, "consumed": consumed},
                        )
                    dist.barrier()
                    rh.checkpoint_saved(step, str(path), manifest=build_manifest(str(path), step, consumed))
                done_after_rollback = resumed_at is not None and step >= resumed_at + args.after_rollback
                if (
                    step >= args.max_steps
                    or done_after_rollback
                    or (step >= args.steps and not args.wait_rollback)
                ):
                    break
            directive = rh.directive
            if directive is None or directive.get("kind") != "rollback":
                break
            checkpoint = Path(directive["checkpoint_path"])
            meta = json.loads((checkpoint / "meta.json").read_text())
            net.load_state_dict(torch.load(checkpoint / "model.pt"))
            states = torch.load(checkpoint / "optim.pt")
            optimizer.load_state_dict(states["optimizer"])
            scheduler.load_state_dict(states["scheduler"])
            cursor, skip = meta["cursor"], skip | set(directive.get("skip_batches") or [])
            rollbacks.append(
                {"directive": directive["id"], "stopped_at": rh.progress["step"], "to": meta["step"]}
            )
            rh.resumed(
                checkpoint_path=str(checkpoint), checkpoint_step=meta["step"], consumed=meta["consumed"]
            )
            resumed_at = meta["step"]
    return {
        "rank": rank,
        "rollbacks": rollbacks,
        "progress": rh.progress,
        "incarnation": rh.incarnation,
        "counters": rh.counters,
        "skip": sorted(skip),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format=f"rank {os.environ.get('RANK')}: %(message)s")
    args = arguments()
    environ = dict(os.environ)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = train(rank, args, environ)
    finally:
        dist.destroy_process_group()
    (args.out / f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
