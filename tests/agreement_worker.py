"""One rank of ``tests/test_collectors_agreement.py``, run as ``python -m tests.agreement_worker``.

A small DDP model on gloo, the hook attached with an in-process transport whose directive poll
hands rank 1 alone a canary re-run whose payload is malformed (``golden`` a list, not a mapping
of stacks), as a faulty or hostile service might send. Acting on it fails on rank 1 only; the
agreement on the job's default group must stay in step with every peer's, or gloo pairs it with a
peer's gradient all-reduce and aborts the process. Writes the hook's counters and progress to
``--out/rank-N.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from collectors import RunHealth, RunHealthConfig
from monitor.demo.process_exit import exit_without_teardown
from monitor.demo.worker import run_rank
from tests.collectors_support import RecordingTransport
from tests.collectors_worker import VOCAB, batches, model

MALFORMED = {"id": 7, "kind": "canary", "act_at_step": None, "payload": {"golden": ["not a mapping"]}}


class MalformedForRankOne(RecordingTransport):
    def directives(self, incarnation: str, rank: int) -> list[dict[str, Any]]:
        return [MALFORMED] if rank == 1 else []


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=60)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def train(rank: int, args: argparse.Namespace, environ: dict[str, str]) -> dict[str, Any]:
    net = DistributedDataParallel(model())
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    config = RunHealthConfig.from_environ(environ)
    config = dataclasses.replace(
        config, directives=dataclasses.replace(config.directives, poll_interval_s=0.05)
    )
    transport = MalformedForRankOne()
    with RunHealth(model=net, optimizer=optimizer, config=config, environ=environ, transport=transport) as rh:
        for batch in rh.windows(batches(rank, args.windows), sample_ids=lambda b: b["ids"]):
            tokens = batch["tokens"]
            logits = net(tokens)[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            rh.loss(loss, labels=tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            time.sleep(args.step_sleep)
    return {"rank": rank, "counters": rh.counters, "progress": rh.progress}


def main() -> None:
    run_rank(train, arguments())
    exit_without_teardown()  # the hook is closed, the group destroyed, the result written


if __name__ == "__main__":
    main()
