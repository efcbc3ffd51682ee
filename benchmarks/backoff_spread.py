"""When ranks that lost the service together ask again: with the sender's jittered backoff and
with the plain doubling (a benchmark, not a test).

Every rank's first batch fails at the same moment (the service went away) and the service comes
back ``--outage-s`` later. Two measures of the same policy (``collectors.backoff``, the
sender's defaults: 0.5 s doubling to 10 s):

- ``model``: ``--ranks`` ranks (16,384 by default), each drawing its delays from its own seeded
  generator as the sender does, on an exact clock: what the policy alone does at fleet scale.
- ``senders``: ``--threads`` real ``Sender`` threads in this process, each with its own spool,
  against a transport that refuses every batch until the service is back: the policy through
  the sender's own loop and timers, on this loaded machine.

Printed as JSON for each, with and without jitter: the tries made during the outage, the most
tries in any ``--bin-s`` interval (the herd the service meets), the spread of the first retry
(standard deviation, and the 1st to 99th percentile range), the most tries in any interval once
the service is back (the herd that meets it then), and how long after its return the ranks got
through (p50, p99, max).

    python benchmarks/backoff_spread.py [--ranks 16384] [--threads 128] [--outage-s 20] [--bin-s 0.1]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter as Tally
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors.backoff import Backoff, rank_seed
from collectors.counters import Counters
from collectors.sender import Sender, SenderConfig
from collectors.spool import Spool, SpoolConfig
from collectors.transport import Delivery, Outcome
from collectors.wire import Record

DEFAULTS = SenderConfig()
RUN, INCARNATION = "fleet-run", "00000000-0000-4000-8000-000000000001"


def modelled(ranks: int, outage_s: float, jitter: bool) -> list[list[float]]:
    """Each rank's tries (seconds after the loss), the last one the first after the return."""
    tries = []
    for rank in range(ranks):
        backoff = Backoff(
            DEFAULTS.retry_initial_s,
            DEFAULTS.retry_max_s,
            jitter=jitter,
            seed=rank_seed(RUN, INCARNATION, rank),
        )
        at, mine = 0.0, [0.0]
        while at < outage_s:
            at += backoff.next_delay_s()
            mine.append(at)
        tries.append(mine)
    return tries


class Outage:
    """Refuses every batch until ``back_at`` (monotonic), then takes them; notes each try."""

    def __init__(self, back_at: float) -> None:
        self.back_at = back_at
        self.tries: list[float] = []
        self._lock = threading.Lock()

    def post(self, records: Sequence[Record]) -> Delivery:
        now = time.monotonic()
        with self._lock:
            self.tries.append(now)
        if now < self.back_at:
            return Delivery(Outcome.RETRY, None, "ConnectionRefusedError: [Errno 111] Connection refused")
        return Delivery(Outcome.DELIVERED, 200)

    def close(self) -> None:
        return None


def threaded(threads: int, outage_s: float, jitter: bool, root: Path) -> list[list[float]]:
    """``threads`` real senders' tries (seconds after the loss)."""
    # Two records fill a batch: each sender wakes at the second, as at a full batch or a flush.
    config = SenderConfig(batch_records=2, retry_jitter=jitter, close_timeout_s=0.0)
    lost = time.monotonic() + 1.0  # every sender started and waiting by then
    outages = [Outage(lost + outage_s) for _ in range(threads)]
    senders = []
    for rank, outage in enumerate(outages):
        counters = Counters()
        spool = Spool(
            SpoolConfig(directory=str(root / str(jitter)), fsync=False), RUN, f"rank{rank}", counters
        )
        senders.append(Sender(config, outage, spool, counters, seed=rank_seed(RUN, INCARNATION, rank)))
    for sender in senders:
        sender.start()
    time.sleep(max(0.0, lost - time.monotonic()))
    for rank, sender in enumerate(senders):  # the trainer's next batch, on every rank at once
        sender.submit({"kind": "step", "incarnation": INCARNATION, "rank": rank, "attempt": 0, "step": 0})
        sender.submit(_filler(rank))
    deadline = lost + outage_s + 2 * DEFAULTS.retry_max_s + 5.0
    while time.monotonic() < deadline and not all(_through(o) for o in outages):
        time.sleep(0.1)
    for sender in senders:
        sender.close()
    return [[at - lost for at in outage.tries] for outage in outages]


def _filler(rank: int) -> Record:
    return {"kind": "step", "incarnation": INCARNATION, "rank": rank, "attempt": 1, "step": 1}


def _through(outage: Outage) -> bool:
    return bool(outage.tries) and outage.tries[-1] >= outage.back_at


def summary(tries: list[list[float]], outage_s: float, bin_s: float) -> dict[str, Any]:
    during = [at for mine in tries for at in mine[1:] if at < outage_s]  # the retries, not the loss
    bins = Tally(int(at / bin_s) for at in during)
    first_retry = sorted(mine[1] for mine in tries if len(mine) > 1)
    back = sorted(mine[-1] - outage_s for mine in tries if mine[-1] >= outage_s)
    after = Tally(int((mine[-1] - outage_s) / bin_s) for mine in tries if mine[-1] >= outage_s)
    return {
        "ranks": len(tries),
        "tries_during_outage": len(during),
        "most_tries_in_one_bin": max(bins.values(), default=0),
        "first_retry_stdev_s": round(statistics.pstdev(first_retry), 4) if first_retry else None,
        "first_retry_p1_p99_s": [round(_quantile(first_retry, q), 4) for q in (0.01, 0.99)],
        "most_tries_in_one_bin_after_return": max(after.values(), default=0),
        "through_after_return_s": {
            "p50": round(_quantile(back, 0.5), 3),
            "p99": round(_quantile(back, 0.99), 3),
            "max": round(back[-1], 3) if back else None,
        },
    }


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--threads", type=int, default=128)
    parser.add_argument("--outage-s", type=float, default=20.0)
    parser.add_argument("--bin-s", type=float, default=0.1)
    args = parser.parse_args()
    logging.getLogger("runhealth").setLevel(logging.ERROR)  # each sender says it is down, once
    result: dict[str, Any] = {"bin_s": args.bin_s, "outage_s": args.outage_s, "load": os.getloadavg()}
    for jitter in (False, True):
        name = "jitter" if jitter else "plain"
        result[f"model_{name}"] = summary(
            modelled(args.ranks, args.outage_s, jitter), args.outage_s, args.bin_s
        )
    with tempfile.TemporaryDirectory(prefix="backoff_spread_") as root:
        for jitter in (False, True):
            name = "jitter" if jitter else "plain"
            tries = threaded(args.threads, args.outage_s, jitter, Path(root))
            result[f"senders_{name}"] = summary(tries, args.outage_s, args.bin_s)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
