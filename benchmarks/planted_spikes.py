"""How small a loss spike the default rules catch on real training noise (a benchmark, not a test).

Single-step spikes (the loss multiplied by a factor at one logged step) are planted into the two
clean real controls, far enough apart that each is judged on an undisturbed trailing window
(every 5,000 steps of Pythia-410M, every 400 of Megatron 15B, from the 300th logged step on).
Each factor is one replay of the whole curve; printed as JSON per curve and factor: spikes
caught (an incident whose first step is the planted step), and incidents anywhere else (false).

    python benchmarks/planted_spikes.py [--factors 1.1 1.2 1.3 1.5 2.0]

The BigScience spikes of the real corpus are x1.6 to x2.7 of their trailing median.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realcurves import clean_controls

from policies.backtest import backtest_series
from policies.series import SeriesConfig
from policies.types import StepPoint

GAPS = {"pythia410m_seed2_clean_with_restarts.csv": 5000, "megatron_gpt3_15b_release_h100.csv": 400}
FIRST = 300


def planted(points: tuple[StepPoint, ...], positions: list[int], factor: float) -> tuple[StepPoint, ...]:
    chosen = set(positions)
    return tuple(
        dataclasses.replace(p, loss=p.loss * factor) if i in chosen and p.loss is not None else p
        for i, p in enumerate(points)
    )


def score(points: tuple[StepPoint, ...], gap: int, factor: float, config: SeriesConfig) -> dict[str, Any]:
    positions = list(range(FIRST, len(points) - 10, gap))
    spiked = {points[i].step for i in positions}
    result = backtest_series(planted(points, positions, factor), config)
    first_steps = {incident.view.first_step for incident in result.incidents}
    return {
        "factor": factor,
        "planted": len(spiked),
        "caught": len(spiked & first_steps),
        "other_incidents": len(first_steps - spiked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", type=float, nargs="+", default=[1.1, 1.2, 1.3, 1.5, 2.0])
    args = parser.parse_args()
    config = SeriesConfig()
    report = {
        case.name: [score(case.points, GAPS[case.name], factor, config) for factor in args.factors]
        for case in clean_controls()
    }
    sys.stdout.write(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
