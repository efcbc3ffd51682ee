"""Which single bit flips in the canary suite's inputs change its fingerprints (a benchmark).

Each trial runs the real suite (``collectors.canary.run_suite``, default ``CanaryConfig``) with
a ``Faults.inputs`` hook that flips one bit of one element of one input tensor of one kernel,
and asks whether that kernel's fingerprint moved from the clean run's. Cells: kernel (which
fixes the precision: four float32 kernels, the bfloat16 GEMM) by bit class. Within a cell the
input tensor, the element and the bit (uniformly within the class) are drawn at random.

Bit classes (bit 0 is the least significant; the mantissa is split in halves, the extra bit
going to the low half):

    float32  (1/8/23): sign 31 | exponent 23-30 | high mantissa 12-22 | low mantissa 0-11
    bfloat16 (1/8/7):  sign 15 | exponent 7-14  | high mantissa 4-6   | low mantissa 0-3

A high-mantissa flip moves a value by 2^-11..2^-1 of its leading bit in float32 and by
2^-3..2^-1 in bfloat16; a low one by 2^-23..2^-12 and 2^-7..2^-4. The per-bit counts in the
JSON show where visibility really ends. Beside the bitwise verdict, each cell also counts the
flips visible through the summary values at the policy's ULP tolerances (what a device alone
on its stack, or a kernel marked non-deterministic, would still catch). A last table flips one
bit of an *output* instead: the fingerprint is a SHA-256 of the output bytes, so that is seen
every time, which the faulty-device benchmark relies on.

    python benchmarks/canary_sensitivity.py [--trials 200] [--output-trials 50] [--seed 1]

Prints JSON on stdout and the same results as markdown tables on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from collectors.canary import KERNELS, CanaryConfig, CanaryFaults, SuiteRun, run_suite
from policies.canary import CanaryConfig as ComparisonConfig
from policies.canary import float32_ulps

CLASSES = ("sign", "exponent", "high_mantissa", "low_mantissa")
BIT_CLASSES: dict[str, dict[str, tuple[int, ...]]] = {
    "float32": {
        "sign": (31,),
        "exponent": tuple(range(23, 31)),
        "high_mantissa": tuple(range(12, 23)),
        "low_mantissa": tuple(range(0, 12)),
    },
    "bfloat16": {
        "sign": (15,),
        "exponent": tuple(range(7, 15)),
        "high_mantissa": tuple(range(4, 7)),
        "low_mantissa": tuple(range(0, 4)),
    },
}
_INTEGER_VIEW = {4: torch.int32, 2: torch.int16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flip_bit(tensor: torch.Tensor, element: int, bit: int) -> torch.Tensor:
    """A copy of ``tensor`` with one bit of one element (flat index) flipped, on its device."""
    width = tensor.element_size() * 8
    flat = tensor.detach().clone().contiguous().view(-1).view(_INTEGER_VIEW[tensor.element_size()])
    mask = 1 << bit
    if mask >= 1 << (width - 1):  # the sign bit, as the signed integer view spells it
        mask -= 1 << width
    flat[element] ^= mask
    return flat.view(tensor.dtype).view(tensor.shape)


def probe_inputs(device: torch.device, config: CanaryConfig) -> dict[str, list[tuple[str, int]]]:
    """Each kernel's inputs (dtype, element count), as the suite hands them to the hook."""
    seen: dict[str, list[tuple[str, int]]] = defaultdict(list)

    def record(kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        seen[kernel].append((dtype_name(tensor.dtype), tensor.numel()))
        return tensor

    run_suite(device, config, CanaryFaults(inputs=record))
    return dict(seen)


@dataclass
class InputFlip:
    """A ``Faults.inputs`` hook: one bit of one element of input ``input_index`` of ``kernel``.

    The element is drawn when the tensor is seen; ``before``/``after`` keep the value (read on
    the host: a benchmark may synchronize)."""

    kernel: str
    input_index: int
    bit: int
    rng: random.Random
    element: int | None = None
    before: float = 0.0
    after: float = 0.0
    _seen: int = 0

    def __call__(self, kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        if kernel != self.kernel:
            return tensor
        position, self._seen = self._seen, self._seen + 1
        if position != self.input_index:
            return tensor
        self.element = self.rng.randrange(tensor.numel())
        flipped = flip_bit(tensor, self.element, self.bit)
        self.before = float(tensor.reshape(-1)[self.element])
        self.after = float(flipped.reshape(-1)[self.element])
        return flipped


@dataclass
class OutputFlip:
    """A ``Faults.output`` hook: one random bit of one random element of ``kernel``'s output."""

    kernel: str
    rng: random.Random

    def __call__(self, kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        if kernel != self.kernel:
            return tensor
        bit = self.rng.randrange(tensor.element_size() * 8)
        return flip_bit(tensor, self.rng.randrange(tensor.numel()), bit)


@dataclass
class Cell:
    kernel: str
    dtype: str
    bit_class: str
    trials: int = 0
    changed: int = 0
    beyond_nondeterministic_ulps: int = 0
    beyond_cross_stack_ulps: int = 0
    nonfinite_inputs: int = 0
    other_kernels_changed: int = 0
    per_bit: dict[int, list[int]] = field(default_factory=dict)  # bit -> [changed, trials]

    def add(self, bit: int, changed: bool, ulps: int, flip: InputFlip, collateral: bool) -> None:
        thresholds = ComparisonConfig()
        self.trials += 1
        self.changed += changed
        self.beyond_nondeterministic_ulps += ulps > thresholds.nondeterministic_ulps
        self.beyond_cross_stack_ulps += ulps > thresholds.cross_stack_ulps
        self.nonfinite_inputs += not math.isfinite(flip.after)
        self.other_kernels_changed += collateral
        counts = self.per_bit.setdefault(bit, [0, 0])
        counts[0] += changed
        counts[1] += 1

    def as_json(self) -> dict[str, Any]:
        bits = BIT_CLASSES[self.dtype][self.bit_class]
        return {
            "kernel": self.kernel,
            "dtype": self.dtype,
            "class": self.bit_class,
            "bits": [min(bits), max(bits)],
            "trials": self.trials,
            "fingerprint_changed": self.changed,
            "fraction": round(self.changed / self.trials, 4) if self.trials else None,
            "summary_beyond_nondeterministic_ulps": self.beyond_nondeterministic_ulps,
            "summary_beyond_cross_stack_ulps": self.beyond_cross_stack_ulps,
            "nonfinite_inputs": self.nonfinite_inputs,
            "other_kernels_changed": self.other_kernels_changed,
            "per_bit": {str(b): self.per_bit[b] for b in sorted(self.per_bit)},
        }


FAR = 2**32  # beyond any tolerance


def _ulps(a: float, b: float) -> int:
    """``float32_ulps``, except that a summary beyond float32's range counts as far away: the
    summaries are float64 sums, and ``float32_ulps`` raises OverflowError past 3.4e38 (reported
    as a bug in policies/canary.py)."""
    try:
        return float32_ulps(a, b)
    except OverflowError:
        return 0 if a == b else FAR


def summary_ulps(run: SuiteRun, clean: SuiteRun, kernel: str) -> int:
    """The largest float32-ULP distance among the kernel's summary values (sum, max |x|, norm)."""
    pairs = zip(run.kernels[kernel].summary, clean.kernels[kernel].summary, strict=True)
    return max(_ulps(a, b) for a, b in pairs)


def input_cell(
    device: torch.device,
    config: CanaryConfig,
    clean: SuiteRun,
    kernel: str,
    inputs: Sequence[tuple[str, int]],
    bit_class: str,
    trials: int,
    rng: random.Random,
) -> Cell:
    dtype = inputs[0][0]
    cell = Cell(kernel, dtype, bit_class)
    for _ in range(trials):
        bit = rng.choice(BIT_CLASSES[dtype][bit_class])
        flip = InputFlip(kernel, rng.randrange(len(inputs)), bit, rng)
        run = run_suite(device, config, CanaryFaults(inputs=flip))
        changed = run.kernels[kernel].fingerprint != clean.kernels[kernel].fingerprint
        collateral = any(run.kernels[k] != clean.kernels[k] for k in KERNELS if k != kernel)
        cell.add(bit, changed, summary_ulps(run, clean, kernel), flip, collateral)
    return cell


def output_flips(
    device: torch.device, config: CanaryConfig, clean: SuiteRun, trials: int, rng: random.Random
) -> dict[str, dict[str, int]]:
    seen = {}
    for kernel in KERNELS:
        changed = sum(
            run_suite(device, config, CanaryFaults(output=OutputFlip(kernel, rng)))
            .kernels[kernel]
            .fingerprint
            != clean.kernels[kernel].fingerprint
            for _ in range(trials)
        )
        seen[kernel] = {"trials": trials, "fingerprint_changed": changed}
    return seen


def pooled(cells: Sequence[Cell], kernels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Cells of several kernels added up per bit class (the by-precision view)."""
    table = {}
    for bit_class in CLASSES:
        chosen = [c for c in cells if c.kernel in kernels and c.bit_class == bit_class]
        trials, changed = sum(c.trials for c in chosen), sum(c.changed for c in chosen)
        table[bit_class] = {
            "trials": trials,
            "fingerprint_changed": changed,
            "fraction": round(changed / trials, 4) if trials else None,
        }
    return table


def measure(
    device: torch.device, config: CanaryConfig, trials: int, output_trials: int, seed: int
) -> dict[str, Any]:
    started = time.perf_counter()
    rng = random.Random(seed)
    clean = run_suite(device, config)
    repeat = run_suite(device, config)
    if repeat.kernels != clean.kernels:  # a flip could not be told from noise: stop here
        raise RuntimeError("the clean suite is not repeatable on this device; sensitivity is meaningless")
    inputs = probe_inputs(device, config)
    cells = [
        input_cell(device, config, clean, kernel, inputs[kernel], bit_class, trials, rng)
        for kernel in KERNELS
        for bit_class in CLASSES
    ]
    fp32 = [k for k in KERNELS if inputs[k][0][0] == "float32"]
    bf16 = [k for k in KERNELS if inputs[k][0][0] == "bfloat16"]
    return {
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seed": seed,
        "trials_per_cell": trials,
        "bit_classes": {
            dtype: {name: [min(bits), max(bits)] for name, bits in classes.items()}
            for dtype, classes in BIT_CLASSES.items()
        },
        "inputs": {k: [{"dtype": d, "elements": n} for d, n in v] for k, v in inputs.items()},
        "tolerances_ulps": {
            "nondeterministic": ComparisonConfig().nondeterministic_ulps,
            "cross_stack": ComparisonConfig().cross_stack_ulps,
        },
        "cells": [c.as_json() for c in cells],
        "by_precision": {"fp32_kernels": pooled(cells, fp32), "bf16_gemm": pooled(cells, bf16)},
        "output_flips": output_flips(device, config, clean, output_trials, rng),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _percent(changed: int, trials: int) -> str:
    return f"{changed}/{trials} ({100 * changed / trials:.1f}%)" if trials else "-"


def markdown(result: Mapping[str, Any]) -> str:
    """The JSON's tables for a human: fingerprint changed / trials per kernel and bit class."""
    header = "| kernel (dtype) | sign | exponent | high mantissa | low mantissa |"
    rule = "|---|---|---|---|---|"
    by_kernel: dict[str, dict[str, Any]] = defaultdict(dict)
    for cell in result["cells"]:
        by_kernel[f"{cell['kernel']} ({cell['dtype']})"][cell["class"]] = cell
    lines = ["Input single-bit flips: fingerprint changed / trials", "", header, rule]
    for name, row in by_kernel.items():
        lines.append(
            f"| {name} | "
            + " | ".join(_percent(row[c]["fingerprint_changed"], row[c]["trials"]) for c in CLASSES)
            + " |"
        )
    for name, table in result["by_precision"].items():
        lines.append(
            f"| **{name}** | "
            + " | ".join(_percent(table[c]["fingerprint_changed"], table[c]["trials"]) for c in CLASSES)
            + " |"
        )
    lines += ["", "Same flips, seen through the summary values beyond the cross-stack tolerance", ""]
    lines += [header, rule]
    for name, row in by_kernel.items():
        lines.append(
            f"| {name} | "
            + " | ".join(
                _percent(row[c]["summary_beyond_cross_stack_ulps"], row[c]["trials"]) for c in CLASSES
            )
            + " |"
        )
    lines += ["", "Output single-bit flips: fingerprint changed / trials", ""]
    lines += ["| kernel | changed |", "|---|---|"]
    for kernel, seen in result["output_flips"].items():
        lines.append(f"| {kernel} | {_percent(seen['fingerprint_changed'], seen['trials'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200, help="input flips per kernel and bit class")
    parser.add_argument("--output-trials", type=int, default=50, help="output flips per kernel")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    result = measure(torch.device(args.device), CanaryConfig(), args.trials, args.output_trials, args.seed)
    print(json.dumps(result, indent=2))
    print(markdown(result), file=sys.stderr)


if __name__ == "__main__":
    main()
