"""The trainer's replay entry point for the recovery tests: ``python -m tests.recovery_replay
[--corrupt R:I] SPEC RESULT``.

It loads the checkpoint the spec names and replays the span up to the first affected step on
one process, emulating the data-parallel ranks (each rank's batch, gradients averaged), once as
recorded and once with the suspect batches skipped, and writes whether the fault reproduced and
whether skipping removed it. The dataset is the workers' own (``recovery_worker.batch``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from tests.recovery_worker import batch, loss_of, model, pair

WORLD = 4


def replay(checkpoint: Path, until: int, skip: set[str], corrupt: tuple[int, int] | None) -> list[list[float]]:
    """Per update from the checkpoint to ``until``: each rank's loss, as the run computed it."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    net = model()
    net.load_state_dict({k.removeprefix("module."): v for k, v in torch.load(checkpoint / "model.pt").items()})
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    states = torch.load(checkpoint / "optim.pt")
    optimizer.load_state_dict(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    cursors = [meta["cursor"]] * WORLD
    losses = []
    for _ in range(meta["step"], until):
        per_rank = []
        for rank in range(WORLD):
            item = batch(rank, cursors[rank], corrupt)
            while item["ids"][0] in skip:
                cursors[rank] += 1
                item = batch(rank, cursors[rank], corrupt)
            cursors[rank] += 1
            loss = loss_of(net, item["tokens"]) / WORLD  # DDP averages the ranks' gradients
            loss.backward()
            per_rank.append(float(loss.detach()) * WORLD)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(per_rank)
    return losses


def spiked(losses: list[list[float]]) -> bool:
    """The last update's worst rank far above everything before it."""
    if len(losses) < 2:
        return max(losses[-1]) > 3.0
    before = [value for step in losses[:-1] for value in step]
    return max(losses[-1]) > 3 * statistics.median(before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corrupt", default=None)
    parser.add_argument("spec", type=Path)
    parser.add_argument("result", type=Path)
    args = parser.parse_args()
    spec: dict[str, Any] = json.loads(args.spec.read_text())
    checkpoint = Path(spec["checkpoint"]["path"])
    until = spec["first_affected_step"]
    corrupt = pair(args.corrupt)
    as_recorded = replay(checkpoint, until, set(), corrupt)
    reproduced = spiked(as_recorded)
    suspects = set(spec["suspect_batches"])
    skipped = replay(checkpoint, until, suspects, corrupt) if reproduced else None
    cleared = None if skipped is None else not spiked(skipped)
    args.result.write_text(json.dumps({
        "reproduced": reproduced, "skip_cleared": cleared, "batches": sorted(suspects) if cleared else [],
        "losses_at_fault": as_recorded[-1],
    }))


if __name__ == "__main__":
    main()
