"""The demo's replay entry point: ``python -m monitor.demo.replay --task T [--corrupt R:I]
[--world N] SPEC RESULT`` (registered as the run's ``replay_command``).

It loads the checkpoint the spec names and replays the span up to the first affected step on
one process, emulating the data-parallel ranks (each rank's batch, gradients averaged), once as
recorded and once with the suspect batches skipped, and writes whether the fault reproduced and
whether skipping removed it. The dataset is the run's own (``tasks.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from monitor.demo.tasks import TASKS, Task, loss_of, pair
from monitor.demo.worker import warmup


def replay(
    task: Task, world: int, checkpoint: Path, until: int, skip: set[str], corrupt: tuple[int, int] | None
) -> list[list[float]]:
    """Per update from the checkpoint to ``until``: each rank's loss, as the run computed it."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    net = task.model()
    net.load_state_dict(
        {k.removeprefix("module."): v for k, v in torch.load(checkpoint / "model.pt").items()}
    )
    optimizer = torch.optim.AdamW(net.parameters())
    scheduler = warmup(optimizer)
    states = torch.load(checkpoint / "optim.pt")
    optimizer.load_state_dict(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    cursors = [meta["cursor"]] * world
    losses = []
    for _ in range(meta["step"], until):
        per_rank = []
        for rank in range(world):
            item = task.batch(rank, cursors[rank], corrupt)
            while item["ids"][0] in skip:
                cursors[rank] += 1
                item = task.batch(rank, cursors[rank], corrupt)
            cursors[rank] += 1
            loss = loss_of(net, item["tokens"], task.vocab)
            (loss / world).backward()  # type: ignore[no-untyped-call]  # DDP averages the ranks' gradients
            per_rank.append(float(loss.detach()))
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
    return max(losses[-1]) > 2 * statistics.median(before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=sorted(TASKS), default="sequence")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--corrupt", default=None)
    parser.add_argument("spec", type=Path)
    parser.add_argument("result", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec: dict[str, Any] = json.loads(args.spec.read_text())
    task, corrupt = TASKS[args.task], pair(args.corrupt)
    checkpoint, until = Path(spec["checkpoint"]["path"]), spec["first_affected_step"]
    as_recorded = replay(task, args.world, checkpoint, until, set(), corrupt)
    reproduced = spiked(as_recorded)
    suspects = set(spec["suspect_batches"])
    cleared = None
    if reproduced:
        cleared = not spiked(replay(task, args.world, checkpoint, until, suspects, corrupt))
    args.result.write_text(
        json.dumps(
            {
                "reproduced": reproduced,
                "skip_cleared": cleared,
                "batches": sorted(suspects) if cleared else [],
                "losses_at_fault": as_recorded[-1],
            }
        )
    )


if __name__ == "__main__":
    main()
