"""What the directive agreement costs the training step at 4 to 256 gloo ranks, and what a
gloo group of its own would cost to create (a benchmark, not a test).

    python benchmarks/agreement.py [--ranks 4 64 256] [--step-ms 20] [--windows 200]
        [--every 4] [--threads-per-process 16] [--warmup 8] [--back-to-back 50]

``collectors.directives.Consensus`` agrees through one 16-byte all-reduce on the job's default
group: ``exchange`` reads the agreement launched at its previous call and launches the next,
asynchronously, at every ``HookConfig.agree_every``-th (4th) window boundary. Here each rank is a
thread with its own ``ProcessGroupGloo`` (two worker threads, loopback) built directly over one
``TCPStore`` hosted by the parent (a client per rank, ``PrefixStore`` per group), 16 rank threads
per worker process (``torch.set_num_threads(1)``): a process that imports torch takes ~280 MB,
so 256 of them do not fit. ``Consensus(torch, group=pg, world_size=N)`` is the real class, run
unchanged: ``dist.all_reduce(..., group=pg, async_op=True)`` works on a group built without
``init_process_group`` (torch 2.13).

Each window sleeps ``--step-ms`` (the step's compute), then does one blocking 16-byte
all-reduce on the same group: the job's own per-step collective, which keeps the ranks in
lockstep as a real job's do and which the job pays anyway (timed apart, ``step_all_reduce_us``).
At every ``--every``-th boundary the rank's training thread times ``consensus.exchange``: wall
time, and the thread's CPU time (which leaves out waiting for the GIL or a core). Also counted:
agreements not complete when read (the read then waited on the network), and answers that are
not what every rank contributed one agreement earlier (must be 0). After the windows: the
16-byte all-reduce back to back (its own latency, ranks in lockstep), and the creation of one
more gloo group over all ranks plus one all-reduce on it (the full-mesh connect the earlier
design paid at attach with ``new_group(backend="gloo")``), from the first rank's start to the
last rank's end, with what rank 0's rendezvous read from the store. Prints JSON per rank count.

Measured (two runs, 2 cores shared with other engineers' test jobs: load average 11-15 before
each rank count, up to 50 during; ranges are the two runs)::

    ranks                          4             64             256
    exchange wall p50 / mean, us   128-173 /     79-102 /       84-390 /
                                   246-293       503-779        1301-2766
    exchange thread CPU p50, us    92-96         63-72          71-87
    agreement per window, us       61-73         126-195        325-692
      (fraction of a 20 ms step)   0.3-0.4 %     0.6-1.0 %      1.6-3.5 %
    measured window, ms            22-23         43-45          123-154
    not complete at read           0 of 200      0 of 3,200     0 of 12,800
    per-step all-reduce mean, ms   1.8-2.5       22-24          101-130
    all-reduce back to back, ms    1.5-1.7       27-32          74-100
    extra group creation, s        0.006-0.014   0.70-0.73      12.4-15.3

What the box distorts: 256 rank threads, 512 gloo worker threads and the gloo I/O threads on 2
cores, with 16 rank threads per GIL all woken together by the lockstep all-reduce. The
exchange's wall time grows with N only through that (its thread CPU does not grow: launch plus
read is ~70-120 us of Python per call here, under 30 us per window), and the window stretches
from 20 ms to 150 ms because every ring hop is a thread wake-up on an oversubscribed core, not a
network transfer. The network figures below are therefore extrapolated from per-hop and
per-connection costs, not read off.

Extrapolation to 16,384 ranks.

Step path. Launch plus read of an async op, once per K = 4 windows: ~100 us of CPU per call
measured here (less on an unloaded server core), ~25 us per window, independent of N as long as
the op completed within K windows (here it always had: 0 of 16,200 reads waited).

NCCL (the default group on GPUs). A 16-byte all-reduce is usually run as a tree: ~2 log2(N)
hops, 2 x 14 = 28 at 16,384 ranks. Assuming ~10 us per inter-node hop (a few us intra-node,
NVLink), that is <= 28 x 10 us = 280 us, plus ~10-20 us of launch: ~0.3 ms, far below K windows
(4 x a step of >= 100 ms at that scale = 400 ms). Even forced to ring (``NCCL_ALGO=Ring``,
2(N-1) = 32,766 hops at ~2-5 us) it is ~65-160 ms, still below 400 ms but without a wide
margin. On the device the op sits in the default group's stream between two windows'
collectives, so it may delay the next window's first collective by its latency: <= ~0.3 ms per
K windows, ~75 us per window (not measured here: no GPU).

Gloo (CPU). The ring's 2(N-1) steps: back to back 1.5-1.7 ms at 4 ranks (6 steps), 27-32 ms at
64 (126), 74-100 ms at 256 (510), i.e. ~145-290 us per step on this box, about linear in N. At
16,384 ranks: 32,766 steps x 145-290 us = 4.8-9.5 s at this box's per-hop cost; with a real
network's ~10-30 us per TCP hop, 0.33-1.0 s. That must fit in K windows, so windows of at least
~0.1-0.25 s; a job whose default group is gloo at that scale pays as much for each of its own
collectives anyway.

A gloo group of its own (the earlier design). Connected as a full mesh: 16,384 x 16,383 / 2 =
134,209,536 TCP connections. Measured 0.006-0.014 s for 6 connections, 0.70-0.73 s for 2,016,
12.4-15.3 s for 32,640: 0.35-0.47 ms per connection at 64-256 ranks, about linear in the
connections (16x the connections from 64 to 256, 17-21x the time). At 16,384 ranks that is
134 million x 0.35-0.47 ms = 47,000-63,000 s (13-17.5 hours) of this box's work; spread
perfectly over 2,048 hosts of 8 ranks, each host holds 8 x 16,383 = 131,064 socket ends (file
descriptors) and ~23-31 s of that work. The rendezvous does not spread: every rank reads every
rank's address key from the job's one TCPStore, and a key is 154 + 8N bytes (rank 0 read 256
keys, 563,712 bytes, at 256 ranks). At 16,384 ranks a key is 131,226 bytes: 2.15 GB read per
rank, 268 million reads and 35 TB served by one store host, about an hour at 10 GB/s (a
100 Gb/s link) before anything else. (Gloo can also connect lazily, on first use:
``create_device(lazy_init=True)`` or ``TORCH_GLOO_LAZY_INIT=1``; ``new_group`` does not by
default, and this benchmark measures the default.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore  # noqa: E402

from collectors.directives import Consensus  # noqa: E402

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=600)  # the groups' and the store's: a stuck rank fails the run
VALUE_EVERY = 3  # the oldest armed id changes every 3rd agreement (checks what is agreed)


def new_group(store: Any, rank: int, world: int) -> Any:
    """A gloo group over ``world`` ranks as ``init_process_group``/``new_group`` would build it
    (two worker threads, full-mesh connect at construction), on the loopback interface."""
    gloo: Any = ProcessGroupGloo  # the stub knows neither ``_Options`` nor the constructor taking it
    options = gloo._Options()
    options._devices = [gloo.create_device(interface="lo")]
    options._timeout = TIMEOUT
    return gloo(store, rank, world, options)


class CountingStore(Store):
    """Counts what a group's rendezvous reads from the store (wraps one rank's store)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.gets = 0
        self.bytes_read = 0

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value: bytes = self.inner.get(key)
        self.gets += 1
        self.bytes_read += len(value)
        return value

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))


def blocking_all_reduce(group: Any) -> None:
    """The job's own per-step collective, stood in for by the agreement's size (16 bytes)."""
    values = torch.zeros(2, dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)


def rank_main(rank: int, config: dict[str, Any], out: dict[str, Any]) -> None:
    """One rank on its own thread: its own store client, its groups, its training loop."""
    world, every, windows, warmup = config["world"], config["every"], config["windows"], config["warmup"]
    step_s = config["step_ms"] / 1000.0
    store = TCPStore(HOST, config["port"], is_master=False, timeout=TIMEOUT)
    group = new_group(PrefixStore("default", store), rank, world)  # the job's default group
    consensus = Consensus(torch, group=group, world_size=world)

    step_ar_ns: list[int] = []
    exchange_ns: list[int] = []
    exchange_cpu_ns: list[int] = []
    not_complete = wrong = calls = 0
    previous = 0
    blocking_all_reduce(group)
    started = time.perf_counter_ns()
    for window in range(warmup + windows):
        if window == warmup:
            started = time.perf_counter_ns()
        time.sleep(step_s)  # the step's compute
        t0 = time.perf_counter_ns()
        blocking_all_reduce(group)  # the step's own collective (keeps the ranks in lockstep)
        t1 = time.perf_counter_ns()
        timed = window >= warmup
        if timed:
            step_ar_ns.append(t1 - t0)
        if (window + 1) % every:
            continue
        value = 1 + calls // VALUE_EVERY  # the same on every rank
        launched = consensus._work  # the agreement in flight (read by this call); not timed
        if timed and launched is not None and not launched.is_completed():
            not_complete += 1
        c0, t2 = time.thread_time_ns(), time.perf_counter_ns()
        agreed = consensus.exchange(value)
        t3, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if calls and agreed != previous:
            wrong += 1
        previous, calls = value, calls + 1
        if timed:
            exchange_ns.append(t3 - t2)
            exchange_cpu_ns.append(c1 - c0)
    loop_ns = time.perf_counter_ns() - started
    consensus.close(wait_s=60.0)

    # The all-reduce's own latency: back to back, the ranks already in lockstep.
    blocking_all_reduce(group)
    t0 = time.perf_counter_ns()
    for _ in range(config["back_to_back"]):
        blocking_all_reduce(group)
    back_to_back_ns = (time.perf_counter_ns() - t0) / config["back_to_back"]

    # One more group over all ranks: what ``new_group(backend="gloo")`` paid at attach.
    blocking_all_reduce(group)
    extra_start = time.monotonic()  # system-wide clock: comparable across the processes
    extra_store = PrefixStore("extra", store)
    counting = CountingStore(extra_store) if rank == 0 else None  # one rank: the GIL it takes
    extra = new_group(counting or extra_store, rank, world)
    blocking_all_reduce(extra)
    extra_end = time.monotonic()
    blocking_all_reduce(group)  # nobody leaves while a peer still needs it

    out.update(
        rank=rank,
        step_all_reduce_ns=step_ar_ns,
        exchange_ns=exchange_ns,
        exchange_cpu_ns=exchange_cpu_ns,
        not_complete_at_read=not_complete,
        wrong_answers=wrong,
        loop_ns=loop_ns,
        back_to_back_ns=back_to_back_ns,
        extra_start=extra_start,
        extra_end=extra_end,
        extra_store_gets=counting.gets if counting else None,
        extra_store_bytes=counting.bytes_read if counting else None,
    )


def worker(config: dict[str, Any], first: int, count: int, path: Path) -> None:
    """A worker process: ``count`` ranks from ``first``, each on a thread; results to ``path``."""
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = [{} for _ in range(count)]

    def run(index: int) -> None:
        try:
            rank_main(first + index, config, results[index])
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # the parent sees it and ends the other workers

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    path.write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # skip tearing down hundreds of gloo pairs one by one


def quantiles_us(samples_ns: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "mean": round(statistics.fmean(ordered) / 1e3, 1),
        "p50": round(statistics.median(ordered) / 1e3, 1),
        "p99": round(p99 / 1e3, 1),
        "max": round(ordered[-1] / 1e3, 1),
    }


def run_world(world: int, windows: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """``world`` ranks in ``ceil(world / threads)`` worker processes over one TCPStore here."""
    processes = math.ceil(world / args.threads_per_process)
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    config = {
        "world": world,
        "port": store.port,
        "every": args.every,
        "windows": windows,
        "warmup": args.warmup,
        "step_ms": args.step_ms,
        "back_to_back": args.back_to_back,
    }
    blocks = [len(range(p, world, processes)) for p in range(processes)]  # sizes, spread evenly
    firsts = [sum(blocks[:p]) for p in range(processes)]
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    children: list[subprocess.Popen[bytes]] = []
    paths = [workdir / f"n{world}-p{p}.json" for p in range(processes)]
    logs = [workdir / f"n{world}-p{p}.log" for p in range(processes)]
    try:
        for p in range(processes):
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                json.dumps(config),
                str(firsts[p]),
                str(blocks[p]),
                str(paths[p]),
            ]
            with logs[p].open("wb") as log:
                children.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.deadline_s
        while any(child.poll() is None for child in children):
            failed = [p for p, child in enumerate(children) if child.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                what = f"worker {failed[0]} failed" if failed else "deadline passed"
                tail = logs[failed[0] if failed else 0].read_text()[-3000:]
                raise RuntimeError(f"{world} ranks: {what}:\n{tail}")
            time.sleep(0.2)
        failed = [p for p, child in enumerate(children) if child.returncode != 0]
        if failed:
            raise RuntimeError(f"{world} ranks: worker {failed[0]} failed:\n{logs[failed[0]].read_text()}")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()  # by PID
                child.wait()
    wall_s = time.monotonic() - started
    ranks = [result for path in paths for result in json.loads(path.read_text())]
    assert sorted(r["rank"] for r in ranks) == list(range(world))
    rank0 = next(r for r in ranks if r["rank"] == 0)

    step_us = args.step_ms * 1000.0
    per_step_us = [sum(r["exchange_ns"]) / windows / 1e3 for r in ranks]
    window_us = statistics.fmean(r["loop_ns"] / windows / 1e3 for r in ranks)
    exchange = [ns for r in ranks for ns in r["exchange_ns"]]
    agreement_us = statistics.fmean(per_step_us)
    return {
        "ranks": world,
        "processes_x_threads": f"{processes}x{max(blocks)}",
        "windows": windows,
        "warmup_windows": args.warmup,
        "every": args.every,
        "step_ms": args.step_ms,
        "agreement_calls_per_rank": len(ranks[0]["exchange_ns"]),
        "agreement_calls_total": len(exchange),
        "exchange_us": quantiles_us(exchange),
        "exchange_thread_cpu_us": quantiles_us([ns for r in ranks for ns in r["exchange_cpu_ns"]]),
        "agreement_not_complete_at_read": sum(r["not_complete_at_read"] for r in ranks),
        "agreement_wrong_answers": sum(r["wrong_answers"] for r in ranks),
        "agreement_us_per_step": round(agreement_us, 2),
        "agreement_us_per_step_worst_rank": round(max(per_step_us), 2),
        "agreement_fraction_of_step": round(agreement_us / step_us, 6),
        "window_ms_measured": round(window_us / 1e3, 2),
        "agreement_fraction_of_window": round(agreement_us / window_us, 6),
        "step_all_reduce_us": {
            k: v
            for k, v in quantiles_us([ns for r in ranks for ns in r["step_all_reduce_ns"]]).items()
            if k in ("mean", "p99")
        },
        "all_reduce_back_to_back_us": round(statistics.fmean(r["back_to_back_ns"] for r in ranks) / 1e3, 1),
        "extra_group_s": round(max(r["extra_end"] for r in ranks) - min(r["extra_start"] for r in ranks), 3),
        "extra_group_connections": world * (world - 1) // 2,
        "extra_group_store_reads_per_rank": {
            "gets": rank0["extra_store_gets"],
            "bytes": rank0["extra_store_bytes"],
        },
        "load_average_before": round(load_before, 2),
        "wall_s": round(wall_s, 1),
    }


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument(
        "--windows", type=int, nargs="+", default=[200], help="one value, or one per --ranks entry"
    )
    parser.add_argument("--warmup", type=int, default=8, help="windows before timing starts")
    parser.add_argument("--every", type=int, default=4, help="HookConfig.agree_every")
    parser.add_argument("--threads-per-process", type=int, default=16)
    parser.add_argument("--back-to-back", type=int, default=50, help="all-reduces timed back to back")
    parser.add_argument("--deadline-s", type=float, default=600.0, help="per rank count")
    args = parser.parse_args()
    windows = args.windows * len(args.ranks) if len(args.windows) == 1 else args.windows
    if len(windows) != len(args.ranks):
        parser.error("--windows takes one value or one per --ranks entry")
    with tempfile.TemporaryDirectory(prefix="agreement-") as tmp:
        results = [run_world(n, w, args, Path(tmp)) for n, w in zip(args.ranks, windows, strict=True)]
    print(json.dumps({"cpu_count": os.cpu_count(), "torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()
