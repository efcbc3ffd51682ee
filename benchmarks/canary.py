"""What the canary suite costs on this machine, and what that costs training (a benchmark).

Measures the real suite (``collectors.canary.run_suite``, default ``CanaryConfig``, CPU
shapes here) per thread count: the first (cold) run of the process apart, then the median of
``--timed`` warm runs, in wall time (what the suite reports and training waits for) and in
process CPU time (less sensitive to other load on a shared machine; the load average is
printed too). A per-kernel split comes from the suite's own fault hooks (time from a kernel's
last input to its output = compute), and the cost of fingerprinting (copy to host, SHA-256,
float64 summaries) is timed apart for the CPU and the GPU output sizes.

Repeatability: ``--repeats`` runs at each thread count, and the number of distinct
fingerprints per kernel (must be 1); also whether fingerprints differ *between* thread counts
(the stack names the thread count because the BLAS partitioning may depend on it).

Schedule arithmetic. "The default schedule" is ``policies.canary.ScheduleConfig()``: the
service (``CanaryWatch.interval_s``) sets the interval to ``canary_interval_s(suite)``, which
is ``suite / budget_fraction`` clamped to [min_interval_s, max_interval_s]; one canary round
per interval, every rank at once at one aligned step, so training runs whole steps between
rounds and a synchronous job pays each round the slowest rank's suite time. With k = ceil(
interval / step) steps between rounds, the fraction of wall time spent in canaries is
``suite / (k * step + suite)`` (what ``CanaryWatch.budget`` measures: canary seconds over the
step records' time span). Shown for steps of 0.1 s and 1 s, at the clamped interval (what
runs) and at the unclamped budget interval (exactly the budget, by construction).

    python benchmarks/canary.py [--timed 30] [--repeats 50] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from collectors.canary import (
    KERNELS,
    CanaryConfig,
    CanaryFaults,
    SuiteRun,
    _fingerprint,  # what run_suite calls on each output: timed apart below
    describe_stack,
    run_suite,
)
from policies.canary import ScheduleConfig, canary_interval_s

CPU = torch.device("cpu")
STEPS_S = (0.1, 1.0)


@dataclass
class KernelClock:
    """Fault hooks that only read the clock: a kernel's compute is the time from its last
    input reaching the hook to its output reaching the hook."""

    last_input: dict[str, float] = field(default_factory=dict)
    compute: dict[str, float] = field(default_factory=dict)

    def inputs(self, kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        self.last_input[kernel] = time.perf_counter()
        return tensor

    def output(self, kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        self.compute[kernel] = time.perf_counter() - self.last_input[kernel]
        return tensor

    def faults(self) -> CanaryFaults:
        return CanaryFaults(inputs=self.inputs, output=self.output)


def timed_run(config: CanaryConfig, clock: KernelClock | None = None) -> tuple[SuiteRun, float]:
    """One suite run, with the process CPU seconds it took."""
    cpu_started = time.process_time()
    run = run_suite(CPU, config, clock.faults() if clock else None)
    return run, time.process_time() - cpu_started


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": round(statistics.median(ordered), 5),
        "min": round(ordered[0], 5),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 5),
        "max": round(ordered[-1], 5),
    }


def time_suite(config: CanaryConfig, timed: int) -> dict[str, Any]:
    runs = [timed_run(config) for _ in range(timed)]
    clocks = [KernelClock() for _ in range(timed)]  # runs of their own: the timed ones carry no hooks
    for clock in clocks:
        timed_run(config, clock)
    return {
        "runs": timed,
        "wall_s": stats([run.seconds for run, _ in runs]),
        "process_cpu_s": stats([cpu for _, cpu in runs]),
        "compute_s_median": {k: round(statistics.median(c.compute[k] for c in clocks), 5) for k in KERNELS},
    }


def repeatability(config: CanaryConfig, repeats: int) -> tuple[dict[str, int], dict[str, str]]:
    """Distinct fingerprints per kernel over ``repeats`` runs, and the first run's."""
    seen: dict[str, Counter[str]] = {k: Counter() for k in KERNELS}
    for _ in range(repeats):
        for kernel, output in run_suite(CPU, config).kernels.items():
            seen[kernel][output.fingerprint] += 1
    return (
        {k: len(v) for k, v in seen.items()},
        {k: v.most_common(1)[0][0] for k, v in seen.items()},
    )


def fingerprint_cost(
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], rounds: int = 5
) -> dict[str, Any]:
    """Host-side fingerprinting (SHA-256 of the bytes, float64 summaries) of outputs this size."""
    costs = {}
    for kernel, (shape, dtype) in shapes.items():
        tensor = torch.randn(shape).to(dtype)
        seconds = []
        for _ in range(rounds):
            started = time.perf_counter()
            _fingerprint(tensor)
            seconds.append(time.perf_counter() - started)
        costs[kernel] = {
            "bytes": tensor.numel() * tensor.element_size(),
            "seconds_median": round(statistics.median(seconds), 5),
        }
    return {"per_kernel": costs, "total_s": round(sum(c["seconds_median"] for c in costs.values()), 5)}


def output_shapes(config: CanaryConfig, gpu: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    n = config.gpu_gemm if gpu else config.cpu_gemm
    rows, cols = config.gpu_softmax if gpu else config.cpu_softmax
    elementwise = config.gpu_elementwise if gpu else config.cpu_elementwise
    return {
        "gemm_fp32": ((n, n), torch.float32),
        "gemm_bf16": ((n, n), torch.bfloat16),
        "reduction_fp32": ((3,), torch.float32),
        "softmax_fp32": ((rows, cols), torch.float32),
        "elementwise_fp32": ((elementwise,), torch.float32),
    }


def schedule_at(suite_s: float, step_s: float, interval_s: float) -> dict[str, Any]:
    """One canary round every ``interval_s``, at a step boundary: k whole steps between rounds."""
    steps_between = math.ceil(interval_s / step_s)
    training_s = steps_between * step_s
    fraction = suite_s / (training_s + suite_s)
    return {
        "interval_s": round(interval_s, 3),
        "steps_between_rounds": steps_between,
        "fraction": fraction,
        "percent": round(100 * fraction, 5),
        "amortized_per_step_ms": round(1000 * suite_s / steps_between, 5),
        "arithmetic": (
            f"{suite_s:.5f} s / ({steps_between} steps x {step_s} s + {suite_s:.5f} s) = {100 * fraction:.5f}%"
        ),
    }


def schedule(suite_s: float, basis: str) -> dict[str, Any]:
    config = ScheduleConfig()
    budget_interval = suite_s / config.budget_fraction
    clamped = canary_interval_s(suite_s, config)
    return {
        "suite_s": round(suite_s, 5),
        "basis": basis,
        "budget_interval_s": round(budget_interval, 3),
        "clamped_interval_s": clamped,
        "clamped_by": (
            "min_interval_s"
            if clamped > budget_interval
            else ("max_interval_s" if clamped < budget_interval else "nothing")
        ),
        "steps": {
            f"{step}s": {
                "at_clamped_interval": schedule_at(suite_s, step, clamped),
                "at_budget_interval": schedule_at(suite_s, step, budget_interval),
            }
            for step in STEPS_S
        },
    }


def measure_threads(config: CanaryConfig, threads: int, timed: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    timing = time_suite(config, timed)
    distinct, fingerprints = repeatability(config, repeats)
    return {
        "threads": threads,
        "stack": describe_stack(CPU),
        **timing,
        "repeats": repeats,
        "distinct_fingerprints": distinct,
        "repeatable": all(count == 1 for count in distinct.values()),
        "fingerprints": fingerprints,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timed", type=int, default=30, help="warm runs timed per thread count")
    parser.add_argument("--repeats", type=int, default=50, help="runs compared per thread count")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: torch's, and 1")
    args = parser.parse_args()
    config = CanaryConfig()
    default_threads = torch.get_num_threads()
    cold_run, cold_cpu = timed_run(config)  # the first torch work of this process: lazy inits included
    threads = args.threads or sorted({default_threads, 1}, reverse=True)
    per_threads = [measure_threads(config, t, args.timed, args.repeats) for t in threads]
    torch.set_num_threads(default_threads)
    trainer = per_threads[0]
    fingerprints_by_threads = {str(p["threads"]): p.pop("fingerprints") for p in per_threads}
    result = {
        "machine": {
            "cpu_model": trainer["stack"]["cpu_model"],
            "cpus": os.cpu_count(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__,
        },
        "config": {
            "cpu_gemm": config.cpu_gemm,
            "cpu_reduction": config.cpu_reduction,
            "cpu_softmax": list(config.cpu_softmax),
            "cpu_elementwise": config.cpu_elementwise,
            "time_budget_s": config.time_budget_s,
        },
        "cold_first_run": {
            "threads": default_threads,
            "wall_s": round(cold_run.seconds, 5),
            "process_cpu_s": round(cold_cpu, 5),
        },
        "per_threads": per_threads,
        "fingerprints_equal_across_threads": {
            k: len({fp[k] for fp in fingerprints_by_threads.values()}) == 1 for k in KERNELS
        },
        "fingerprint_cost_host": {
            "cpu_shapes": fingerprint_cost(output_shapes(config, gpu=False)),
            "gpu_shapes_hashed_on_this_cpu": fingerprint_cost(output_shapes(config, gpu=True)),
        },
        "schedule_config": vars(ScheduleConfig()),
        "schedule": [
            schedule(p["wall_s"][stat], f"warm {stat} at {p['threads']} threads ({why})")
            for p in per_threads
            for stat, why in (("median", "every rank equal"), ("max", "a rank this slow every round"))
        ],
        "first_round_extra_s": round(cold_run.seconds - trainer["wall_s"]["median"], 5),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
