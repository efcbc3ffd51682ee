"""What the hook costs a training step: the same small training with and without it, interleaved.

One model trains in one process, its steps taking turns between three kinds: bare, hooked, and
with four calls that do nothing at the hook's four places (each kind takes each place in the
order equally often). One model, not several identical ones: two instances differ in memory
placement, and that difference (up to 60 us a step here) would swamp what is measured. A hooked
step records its window the way a plain loop attaches the hook (loss with labels, sample ids,
grad norm, the optimizer watched) and sends to the embedded service (a child process, as in
production the service is elsewhere: its CPU is not the trainer's).

Printed as JSON: the median step-time ratio (hooked / bare), and the hook's added process CPU
per step, measured two ways:

- Whole step: each step's process CPU less the sender thread's share (its own thread clock);
  hooked minus bare, step by step, averaged; plus the sender thread's CPU per step, measured
  over a stretch of steps that are all hooked (``hooked_throughout``). Counts everything, also
  what the hook's code costs the training around it (caches it evicts), but a step's CPU
  varies by about a millisecond, so the standard error is 10-30 us. The same for the no-op
  calls is this method's floor on the machine: the first Python after a step's kernels runs
  on caches they evicted, whatever it does.
- Direct: the training thread's time in the hook's four calls (wall time, the slowest 1% of
  steps left out as preempted) over the stretch of hooked steps, less the same clock readings
  around nothing in bare steps; the time its optimizer hooks add to ``optimizer.step``
  (hooked minus bare, interleaved); plus the sender thread's CPU. Precise to a microsecond or
  two, blind to effects on the code around the hook. The calls are also timed in the
  interleaved steps (``hook_calls_us_per_step_interleaved``): there the hook's code runs every
  third step, after two steps that evicted it, and costs 6-7 us more than in a hooked run.

    python benchmarks/hook_overhead.py [--steps 600] [--warmup 50] [--sender-steps N]

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
    # Hooked throughout (``hooked_throughout``). The sender's work comes in bursts (a batch
    # every 2 s, a heartbeat every 5 s, a reconnect now and then): over 500 steps (10 s) its
    # CPU per step varied by 8 us from run to run; ``main`` takes a third of ``steps``.
    sender_steps: int = 500


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
    optimizer_s: list[float] = field(default_factory=list)
    hook_calls_s: list[float] = field(default_factory=list)  # thread CPU at the four call sites

    def clear(self) -> None:
        for values in (self.wall_s, self.cpu_s, self.sender_cpu_s, self.optimizer_s, self.hook_calls_s):
            values.clear()


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


def bare_step(side: Training, batch: dict[str, Any], timings: Timings) -> None:
    # The clock is read as in ``hooked_step``, at the same points, around nothing: the direct
    # measure subtracts what the readings cost, and the whole-step difference does not see them.
    clock = time.perf_counter
    tokens = batch["tokens"]
    started = clock()
    calls = clock() - started
    logits = side.model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    started = clock()
    calls += clock() - started
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(side.model.parameters(), 1.0)
    started = clock()
    calls += clock() - started
    started = clock()
    side.optimizer.step()  # the hook's optimizer hooks run here in both kinds of step
    timings.optimizer_s.append(clock() - started)
    side.optimizer.zero_grad(set_to_none=True)
    started = clock()
    timings.hook_calls_s.append(calls + clock() - started)


def hooked_step(side: Training, batch: dict[str, Any], rh: RunHealth, timings: Timings) -> None:
    clock = time.perf_counter  # around each hook call: the direct measure (``summarize``)
    tokens = batch["tokens"]
    started = clock()
    rh.window_start(sample_ids=batch["ids"])
    calls = clock() - started
    logits = side.model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    started = clock()
    rh.loss(loss, labels=tokens)  # labels = inputs, shifted: the hook's default convention
    calls += clock() - started
    loss.backward()  # type: ignore[no-untyped-call]
    norm = torch.nn.utils.clip_grad_norm_(side.model.parameters(), 1.0)
    started = clock()
    rh.grad_norm(norm)
    calls += clock() - started
    started = clock()
    side.optimizer.step()
    timings.optimizer_s.append(clock() - started)
    side.optimizer.zero_grad(set_to_none=True)
    started = clock()
    rh.window_end()
    timings.hook_calls_s.append(calls + clock() - started)


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
    bare, hooked, noop = Timings(), Timings(), Timings()
    batches = make_batches(config, 64)
    environ = {"RUNHEALTH_DB": str(workdir / "bench.db"), "RUNHEALTH_RUN": "hook-overhead",
               "RUNHEALTH_SPOOL_DIR": str(workdir / "spool"), **_child_environ()}  # fmt: skip
    with RunHealth(model=training.model, optimizer=training.optimizer, environ=environ) as rh:
        sender_cpu = sender_clock()
        for index in range(config.warmup + config.steps):
            batch = batches[index % len(batches)]
            kinds = [
                (bare, lambda b=batch: bare_step(training, b, bare)),
                (hooked, lambda b=batch: hooked_step(training, b, rh, hooked)),
                (noop, lambda b=batch: hooked_step(training, b, NOOP, noop)),  # type: ignore[arg-type]
            ]
            # Each kind takes each place in the order equally often.
            order = kinds[index % 3 :] + kinds[: index % 3]
            for timings, step in order if (index // 3) % 2 == 0 else reversed(order):
                measure(timings, step, sender_cpu)
            if index == config.warmup - 1:
                for timings in (bare, hooked, noop):
                    timings.clear()
        throughout, sender, service = hooked_throughout(config, training, batches, rh, sender_cpu)
        counters = rh.counters
    result = summarize(config, bare, hooked, noop, throughout, sender, counters)
    result["embedded_service_cpu_us_per_step"] = 1e6 * service  # its own process: not added
    return result


def hooked_throughout(
    config: BenchmarkConfig, training: Training, batches: list[dict[str, Any]], rh: RunHealth, sender_cpu: Any
) -> tuple[Timings, float, float]:
    """A stretch of a run that is hooked throughout, as a hooked training is: the hook's calls
    as timed there, and the sender thread's CPU per step. In the interleaved run a hooked step
    comes every third step, so the sender's per-second part (heartbeats, a POST's and a poll's
    fixed cost each cycle) would be charged three times over, and the hook's code runs after
    two steps that are not its own. Also the embedded service's CPU per step there: on a
    machine with few cores it competes with the training for them."""
    timings = Timings()
    for index in range(config.warmup):  # the sender's queue and cycle settle to this pace
        hooked_step(training, batches[index % len(batches)], rh, timings)
    timings.clear()
    started, service = sender_cpu(), process_cpu(rh.embedded_pid)
    for index in range(config.sender_steps):
        hooked_step(training, batches[index % len(batches)], rh, timings)
    service_s = process_cpu(rh.embedded_pid) - service
    return timings, float(sender_cpu() - started) / config.sender_steps, service_s / config.sender_steps


def process_cpu(pid: int | None) -> float:
    """A child process's CPU seconds so far (Linux ``/proc``; 0 without one)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(
    config: BenchmarkConfig,
    bare: Timings,
    hooked: Timings,
    noop: Timings,
    throughout: Timings,
    sender: float,
    counters: dict[str, int],
) -> dict[str, Any]:
    # The whole-step measure. The sender runs whenever it likes, in steps of every kind: its
    # CPU is taken out of each step (its own thread clock); the hook's share per step is
    # measured apart (``hooked_throughout``). The rest of a step's process CPU is the training
    # thread's; the mean of hooked minus bare, step by step, is what the hook adds there, and
    # its standard error says how far to trust it.
    steps = len(hooked.cpu_s)
    sender_total = sum(bare.sender_cpu_s) + sum(hooked.sender_cpu_s) + sum(noop.sender_cpu_s)
    added = [h - b for h, b in zip(training_cpu(hooked), training_cpu(bare), strict=True)]
    # Four calls that do nothing, at the same places: the floor of this method on this machine
    # (the first Python after a training step's kernels runs on caches the step evicted).
    floor = [n - b for n, b in zip(training_cpu(noop), training_cpu(bare), strict=True)]
    # The direct measure: the hook's own code, timed where it runs. The training thread's time
    # in its four calls in a hooked run and in ``optimizer.step`` (where its optimizer hooks
    # run; interleaved, hooked minus bare), less the same clock readings in bare steps
    # (``trimmed_mean`` says why wall time), and the sender thread's CPU. It leaves out what the
    # hook's code costs the training around it (caches it evicts), which only the whole-step
    # difference sees, within its error.
    readings = trimmed_mean(bare.hook_calls_s)
    calls = trimmed_mean(throughout.hook_calls_s) - readings
    optimizer_hooks = trimmed_mean(hooked.optimizer_s) - trimmed_mean(bare.optimizer_s)
    noop_calls = trimmed_mean(noop.hook_calls_s) - trimmed_mean(bare.hook_calls_s)
    return {
        "steps": steps,
        "bare_step_ms_median": 1e3 * statistics.median(bare.wall_s),
        "hooked_step_ms_median": 1e3 * statistics.median(hooked.wall_s),
        "step_time_ratio_median": statistics.median(hooked.wall_s) / statistics.median(bare.wall_s),
        "added_process_cpu_us_per_step": 1e6 * (statistics.fmean(added) + sender),
        "added_process_cpu_us_stderr": 1e6 * statistics.stdev(added) / math.sqrt(steps),
        "of_which_sender_thread_us_per_step": 1e6 * sender,
        "sender_thread_us_per_hooked_step_interleaved": 1e6 * sender_total / steps,  # see above
        "four_noop_calls_added_cpu_us_per_step": 1e6 * statistics.fmean(floor),
        "four_noop_calls_added_cpu_us_stderr": 1e6 * statistics.stdev(floor) / math.sqrt(steps),
        "direct": {
            "hook_calls_us_per_step": 1e6 * calls,
            "hook_calls_us_per_step_interleaved": 1e6 * (trimmed_mean(hooked.hook_calls_s) - readings),
            "optimizer_hooks_us_per_step": 1e6 * optimizer_hooks,
            "sender_thread_us_per_step": 1e6 * sender,
            "total_us_per_step": 1e6 * (calls + optimizer_hooks + sender),
            "four_noop_calls_us_per_step": 1e6 * noop_calls,
        },
        "targets": {"step_time_ratio_median": 1.01, "added_process_cpu_us_per_step": 50.0},
        "records": {name: counters[name] for name in ("sent", "spooled", "dropped", "hook_errors")},
        "config": asdict(config),
        "torch": torch.__version__,
    }


def trimmed_mean(values: list[float], top: float = 0.01) -> float:
    """The mean without the slowest ``top`` share: the hook's calls never block, so their wall
    time is their CPU time except when the OS or the sender thread (the GIL) preempts them,
    which takes milliseconds where a call takes microseconds. Reading the thread's CPU clock
    instead costs a system call, and the one after the hook's code runs cold: it overstated
    the calls by about 20 us."""
    kept = sorted(values)[: max(1, round(len(values) * (1 - top)))]
    return statistics.fmean(kept)


def training_cpu(timings: Timings) -> list[float]:
    """Each step's process CPU less the sender thread's share of it."""
    return [cpu - sender for cpu, sender in zip(timings.cpu_s, timings.sender_cpu_s, strict=True)]


class NoopHook:
    """The hook's four step-path methods, doing nothing."""

    def window_start(self, *, sample_ids: Any = None) -> None:
        pass

    def loss(self, loss: Any, *, labels: Any = None) -> None:
        pass

    def grad_norm(self, norm: Any) -> None:
        pass

    def window_end(self) -> None:
        pass


NOOP = NoopHook()


def _child_environ() -> dict[str, str]:
    """What the embedded service's child process needs from this environment (PATH and the
    import path); the benchmark otherwise keeps its environment to itself."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=BenchmarkConfig.steps)
    parser.add_argument("--warmup", type=int, default=BenchmarkConfig.warmup)
    parser.add_argument("--sender-steps", type=int, default=None, help="default: max(500, steps / 3)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sender_steps = args.sender_steps or max(BenchmarkConfig.sender_steps, args.steps // 3)
    config = BenchmarkConfig(steps=args.steps, warmup=args.warmup, sender_steps=sender_steps)
    with tempfile.TemporaryDirectory(prefix="runhealth-bench-") as workdir:
        result = run(config, Path(workdir))
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
