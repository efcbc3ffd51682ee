"""What the hook costs a training step: the same small training with and without it, interleaved.

One model trains in one process, its steps alternating between bare and hooked (bare, hooked,
hooked, bare, ...: the order alternates so neither kind always runs second). One model, not two
identical ones: two instances differ in memory placement, and that difference (up to 60 us a
step here) would swamp what is measured. A hooked step records its window the way a plain loop
attaches the hook (loss with labels, sample ids, grad norm, the optimizer watched) and sends to
the embedded service (a child process, as in production the service is elsewhere: its CPU is
not the trainer's). The optimizer's step hooks also run, as no-ops, in bare steps; that few
microseconds is the one part of the hook's cost not counted.

Printed as JSON: the median step-time ratio (hooked / bare), and the hook's added process CPU
per step. Process CPU (``time.process_time``) covers every thread of the trainer, so the sender
thread's batching, encoding and HTTP count too; since the sender runs whenever it likes, its CPU
spent during bare steps is measured from its own thread clock and moved to the hooked side.

    python benchmarks/hook_overhead.py [--steps 600] [--warmup 50]

Targets: at most 50 us of added process CPU per step, and a ratio of at most 1.01, for a model
whose step takes about 20 ms.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

from collectors import RunHealth  # noqa: E402

VOCAB = 256
LOG = logging.getLogger("runhealth.benchmark")


@dataclass(frozen=True)
class BenchmarkConfig:
    """A model whose step takes about 20 ms on one core of the reference CPU (measured:
    21-22 ms for width 128, 2 layers, 8 sequences of 64 tokens)."""

    steps: int = 600
    warmup: int = 50
    width: int = 128
    layers: int = 2
    batch: int = 8
    seq_len: int = 64


@dataclass(frozen=True)
class Training:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


@dataclass
class Timings:
    """What one kind of step (bare or hooked) cost, step by step."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    sender_cpu_s: list[float] = field(default_factory=list)

    def clear(self) -> None:
        self.wall_s.clear()
        self.cpu_s.clear()
        self.sender_cpu_s.clear()


def build_training(config: BenchmarkConfig) -> Training:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        config.width, 4, 4 * config.width, dropout=0.0, batch_first=True, norm_first=True
    )
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, config.width),
        torch.nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False),
        torch.nn.Linear(config.width, VOCAB),
    )
    return Training(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def make_batches(config: BenchmarkConfig, count: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (config.batch, config.seq_len + 1), generator=generator),
            "ids": list(range(index * config.batch, (index + 1) * config.batch)),
        }
        for index in range(count)
    ]


def bare_step(side: Training, batch: dict[str, Any]) -> None:
    tokens = batch["tokens"]
    logits = side.model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(side.model.parameters(), 1.0)
    side.optimizer.step()
    side.optimizer.zero_grad(set_to_none=True)


def hooked_step(side: Training, batch: dict[str, Any], rh: RunHealth) -> None:
    tokens = batch["tokens"]
    rh.window_start(sample_ids=batch["ids"])
    logits = side.model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    rh.loss(loss, labels=tokens)  # labels = inputs, shifted: the hook's default convention
    loss.backward()  # type: ignore[no-untyped-call]
    rh.grad_norm(torch.nn.utils.clip_grad_norm_(side.model.parameters(), 1.0))
    side.optimizer.step()
    side.optimizer.zero_grad(set_to_none=True)
    rh.window_end()


def sender_clock() -> Any:
    """The sender thread's CPU clock (Linux: a per-thread clock id)."""
    sender = next(thread for thread in threading.enumerate() if thread.name == "runhealth-sender")
    assert sender.ident is not None
    clock_id = time.pthread_getcpuclockid(sender.ident)
    return lambda: time.clock_gettime(clock_id)


def measure(timings: Timings, step: Any, sender_cpu: Any) -> None:
    wall, cpu, sender = time.perf_counter(), time.process_time(), sender_cpu()
    step()
    timings.wall_s.append(time.perf_counter() - wall)
    timings.cpu_s.append(time.process_time() - cpu)
    timings.sender_cpu_s.append(sender_cpu() - sender)


def run(config: BenchmarkConfig, workdir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)  # one core: the hook's threads compete with the step for it
    training = build_training(config)
    bare, hooked = Timings(), Timings()
    batches = make_batches(config, 64)
    environ = {"RUNHEALTH_DB": str(workdir / "bench.db"), "RUNHEALTH_RUN": "hook-overhead",
               "RUNHEALTH_SPOOL_DIR": str(workdir / "spool"), **_child_environ()}  # fmt: skip
    with RunHealth(model=training.model, optimizer=training.optimizer, environ=environ) as rh:
        sender_cpu = sender_clock()
        for index in range(config.warmup + config.steps):
            batch = batches[index % len(batches)]
            pair = [
                (bare, lambda b=batch: bare_step(training, b)),
                (hooked, lambda b=batch: hooked_step(training, b, rh)),
            ]
            for timings, step in pair if index % 2 == 0 else reversed(pair):
                measure(timings, step, sender_cpu)
            if index == config.warmup - 1:
                bare.clear()
                hooked.clear()
        counters = rh.counters
    return summarize(config, bare, hooked, counters)


def summarize(
    config: BenchmarkConfig, bare: Timings, hooked: Timings, counters: dict[str, int]
) -> dict[str, Any]:
    # Per pair of steps: process CPU of the hooked step, minus the bare one, plus twice the
    # sender CPU that fell into the bare step (counted there, but the hook's): the mean is the
    # hook's added process CPU per step; its standard error says how far to trust it.
    added = [
        hooked_cpu - bare_cpu + 2 * bare_sender
        for hooked_cpu, bare_cpu, bare_sender in zip(hooked.cpu_s, bare.cpu_s, bare.sender_cpu_s, strict=True)
    ]
    steps = len(added)
    sender = (sum(bare.sender_cpu_s) + sum(hooked.sender_cpu_s)) / steps
    return {
        "steps": steps,
        "bare_step_ms_median": 1e3 * statistics.median(bare.wall_s),
        "hooked_step_ms_median": 1e3 * statistics.median(hooked.wall_s),
        "step_time_ratio_median": statistics.median(hooked.wall_s) / statistics.median(bare.wall_s),
        "added_process_cpu_us_per_step": 1e6 * statistics.fmean(added),
        "added_process_cpu_us_stderr": 1e6 * statistics.stdev(added) / math.sqrt(steps),
        "of_which_sender_thread_us_per_step": 1e6 * sender,
        "targets": {"step_time_ratio_median": 1.01, "added_process_cpu_us_per_step": 50.0},
        "records": {name: counters[name] for name in ("sent", "spooled", "dropped", "hook_errors")},
        "config": asdict(config),
        "torch": torch.__version__,
    }


def _child_environ() -> dict[str, str]:
    """What the embedded service's child process needs from this environment (PATH and the
    import path); the benchmark otherwise keeps its environment to itself."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=BenchmarkConfig.steps)
    parser.add_argument("--warmup", type=int, default=BenchmarkConfig.warmup)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = BenchmarkConfig(steps=args.steps, warmup=args.warmup)
    with tempfile.TemporaryDirectory(prefix="runhealth-bench-") as workdir:
        result = run(config, Path(workdir))
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
