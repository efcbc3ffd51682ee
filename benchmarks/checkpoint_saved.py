"""What ``rh.checkpoint_saved`` costs the training thread for one large checkpoint file.

Before the manifest worker, a rollback target needed its manifest handed in, so the trainer (and
the transformers adapter, after a barrier) hashed every byte on the training thread:
``rh.checkpoint_saved(step, path, manifest=build_manifest(path, step))``. Now
``rh.checkpoint_saved(step, path)`` returns at once and the hook's manifest worker hashes the
file on its own thread. Both are timed here on the same file, alternating, with the hook sending
to an in-process sink; printed as JSON: the training thread's time per call (median, max) each
way, and how long after the call the record with its manifest was handed to the sender.

    python benchmarks/checkpoint_saved.py [--megabytes 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

from collectors import HookConfig, RunHealth, RunHealthConfig, build_manifest  # noqa: E402
from collectors.sender import SenderConfig  # noqa: E402
from collectors.spool import SpoolConfig  # noqa: E402
from collectors.transport import Delivery, Outcome, TransportConfig  # noqa: E402
from collectors.wire import Record  # noqa: E402


class Sink:
    """Takes every batch; notes when each checkpoint record arrived."""

    def __init__(self) -> None:
        self.arrived: dict[int, float] = {}
        self.changed = threading.Condition()

    def post(self, records: Sequence[Record]) -> Delivery:
        with self.changed:
            for record in records:
                if record["kind"] == "checkpoint" and record.get("manifest"):
                    self.arrived[int(record["step"])] = time.perf_counter()
            self.changed.notify_all()
        return Delivery(Outcome.DELIVERED, 200)

    def close(self) -> None:
        return None

    def wait_for(self, step: int, timeout_s: float = 120.0) -> float:
        with self.changed:
            self.changed.wait_for(lambda: step in self.arrived, timeout_s)
            return self.arrived[step]


def measure(megabytes: int, repeats: int, root: Path) -> dict[str, Any]:
    path = root / "ckpt.pt"
    with open(path, "wb") as handle:
        for _ in range(megabytes):
            handle.write(os.urandom(1 << 20))
    sink = Sink()
    config = RunHealthConfig(
        transport=TransportConfig(run="checkpoint-bench"),
        spool=SpoolConfig(directory=str(root / "spool")),
        sender=SenderConfig(flush_interval_s=0.05, heartbeat_interval_s=60.0),
        hook=HookConfig(manifest_settle_s=0.05),
    )
    rh = RunHealth(config=config, transport=sink, environ={}, hostname=lambda: "bench")
    hashed_on_call, returned_at_once, recorded_after = [], [], []
    with rh.start():
        for repeat in range(repeats):
            step = 2 * repeat + 1
            started = time.perf_counter()
            rh.checkpoint_saved(step, str(path), manifest=build_manifest(path, step))
            hashed_on_call.append(time.perf_counter() - started)
            sink.wait_for(step)
            started = time.perf_counter()
            rh.checkpoint_saved(step + 1, str(path))
            returned_at_once.append(time.perf_counter() - started)
            recorded_after.append(sink.wait_for(step + 1) - started)
    return {
        "megabytes": megabytes,
        "repeats": repeats,
        "before_manifest_on_training_thread_s": summary(hashed_on_call),
        "after_training_thread_s": summary(returned_at_once),
        "after_record_with_manifest_sent_after_s": summary(recorded_after),
    }


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "max": max(values), "each": [round(v, 6) for v in values]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as root:
        print(json.dumps(measure(args.megabytes, args.repeats, Path(root)), indent=2))


if __name__ == "__main__":
    main()
