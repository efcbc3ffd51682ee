"""Canaries in the service: rounds judged when every rank reported, golden fingerprints kept
per stack, targeted re-runs, and a budgeted schedule that survives a restart.

A round is every rank's canary result at one step (the step a ``canary`` directive named, so
synchronous training pays for it once). The comparison is pure (``policies.canary``).
"""

from __future__ import annotations

import statistics
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor.judge.config import CanaryServiceConfig
from monitor.judge.incidents import IncidentRecorder
from monitor.recovery import directives
from monitor.store import models
from policies.canary import (
    CanaryResult,
    CanaryRound,
    KernelResult,
    canary_interval_s,
    spent_fraction,
)
from policies.registry import CanaryPolicy, canary_policy

RESULT = models.table_of(models.CanaryResult)
GOLDEN = models.table_of(models.CanaryGolden)
SCHEDULE = models.table_of(models.CanarySchedule)
INCARNATION = models.table_of(models.Incarnation)
SUMMARY = models.table_of(models.StepSummary)
DIRECTIVE = models.table_of(models.Directive)


def _kernels(raw: dict[str, Any] | None) -> dict[str, KernelResult]:
    return {
        name: KernelResult(
            k["fingerprint"], tuple(k.get("summary") or ()), bool(k.get("deterministic", True))
        )
        for name, k in (raw or {}).items()
    }


class CanaryWatch:
    def __init__(
        self,
        engine: Engine,
        config: CanaryServiceConfig,
        recorder: IncidentRecorder,
        clock: Callable[[], float],
        on_hardware: Callable[[int, list[int]], object] = lambda _run, _ranks: None,
        comparison: CanaryPolicy | None = None,
    ) -> None:
        self._engine = engine
        self._config = config
        # The round's verdict also names the golden fingerprints to keep and the ranks to re-run.
        self._comparison = comparison if comparison is not None else canary_policy(config.comparison)
        self._recorder = recorder
        self._clock = clock
        self._on_hardware = on_hardware
        self._lock = threading.Lock()

    def judge(self, run_id: int, force: bool = False) -> list[int]:
        """Judge every complete round of a run (or every round, when ``force``)."""
        now = self._clock()
        touched: list[int] = []
        flagged: list[int] = []
        with self._lock, self._engine.begin() as connection:
            self._attach_reruns(connection, run_id)
            pending = connection.execute(
                sa.select(RESULT.c.incarnation, RESULT.c.step)
                .where(RESULT.c.run_id == run_id, RESULT.c.judged.is_(False))
                .distinct()
            ).all()
            for incarnation, step in sorted(pending, key=lambda key: key[1]):
                rows = [
                    dict(row)
                    for row in connection.execute(
                        sa.select(RESULT).where(
                            RESULT.c.run_id == run_id,
                            RESULT.c.incarnation == incarnation,
                            RESULT.c.step == step,
                        )
                    ).mappings()
                ]
                world = self._world(connection, run_id, incarnation)
                unjudged = [r for r in rows if not r["judged"]]
                waited = now - min(r["received_at"] for r in unjudged) >= self._config.round_wait_s
                if len({r["rank"] for r in rows}) < world and not (force or waited):
                    continue
                round_touched, round_flagged = self._judge_round(connection, run_id, rows, now)
                touched += round_touched
                flagged += round_flagged
        if flagged:
            self._on_hardware(run_id, flagged)
        return touched

    def _attach_reruns(self, connection: Connection, run_id: int) -> None:
        """A targeted re-run answers for its original result: its kernels become that result's
        ``rerun`` and the original is judged again, against the golden or its own round."""
        reruns = connection.execute(
            sa.select(RESULT.c.id, RESULT.c.rank, RESULT.c.kernels, DIRECTIVE.c.payload)
            .join(DIRECTIVE, DIRECTIVE.c.id == RESULT.c.directive_id)
            .where(RESULT.c.run_id == run_id, RESULT.c.judged.is_(False))
        ).all()
        for rerun in reruns:
            original = (rerun.payload or {}).get("rerun_of")
            if not original:
                continue
            connection.execute(
                RESULT.update()
                .where(
                    RESULT.c.run_id == run_id,
                    RESULT.c.incarnation == original["incarnation"],
                    RESULT.c.step == original["step"],
                    RESULT.c.rank == rerun.rank,
                )
                .values(rerun=rerun.kernels, judged=False, verdict=None)
            )
            connection.execute(
                RESULT.update().where(RESULT.c.id == rerun.id).values(judged=True, verdict="rerun_result")
            )

    def judge_waiting(self, among: Collection[int] | None = None) -> list[int]:
        """Rounds of every run (of ``among``, when given) that waited long enough for missing
        ranks."""
        query = sa.select(RESULT.c.run_id).where(RESULT.c.judged.is_(False)).distinct()
        if among is not None:
            query = query.where(RESULT.c.run_id.in_(sorted(among)))
        with self._engine.connect() as connection:
            runs = connection.execute(query).scalars().all()
        return [incident for run_id in runs for incident in self.judge(run_id)]

    def _world(self, connection: Connection, run_id: int, incarnation: str) -> int:
        world = connection.execute(
            sa.select(INCARNATION.c.world_size).where(
                INCARNATION.c.run_id == run_id, INCARNATION.c.incarnation == incarnation
            )
        ).scalar()
        return int(world or 1)

    def _judge_round(
        self, connection: Connection, run_id: int, rows: list[dict[str, Any]], now: float
    ) -> tuple[list[int], list[int]]:
        results = [
            CanaryResult(
                rank=r["rank"],
                node=r["node"],
                device=r["device_uuid"],
                stack=r["stack_key"],
                step=r["step"],
                kernels=_kernels(r["kernels"]),
                rerun=_kernels(r["rerun"]) if r["rerun"] else None,
                incarnation=r["incarnation"],
            )
            for r in rows
        ]
        golden = self._golden(connection, {r.stack for r in results})
        _, verdict = self._comparison.judge(None, CanaryRound(results, golden))
        # Judged ranks took part as references; only the others get verdicts now.
        unjudged = {r["rank"] for r in rows if not r["judged"]}
        verdict = replace(
            verdict,
            findings=tuple(f for f in verdict.findings if f.rank in unjudged),
            rerun_wanted=tuple(r for r in verdict.rerun_wanted if r in unjudged),
        )
        self._keep_golden(connection, verdict.new_golden, results, run_id, now)
        findings = [
            replace(
                f,
                step=self._last_good(connection, run_id, f.device, f.step) + 1,
                evidence={**f.evidence, "canary_step": f.step},
            )
            for f in verdict.findings
        ]
        touched = self._recorder.record(connection, run_id, findings, rows[0]["step"])
        if verdict.rerun_wanted:
            directives.create_directive(
                connection,
                run_id,
                "canary",
                created_by="engine",
                now=now,
                incarnation=rows[0]["incarnation"],
                ranks=list(verdict.rerun_wanted),
                payload={
                    "golden": self.golden_payload(connection, run_id),
                    "reason": "re-run after a mismatch",
                    "rerun_of": {"incarnation": rows[0]["incarnation"], "step": rows[0]["step"]},
                },
            )
        flagged_ranks = {f.rank for f in verdict.findings}
        for row in rows:
            if row["rank"] not in unjudged:
                continue  # a reference here, judged in its own time
            verdict_of = (
                "mismatch"
                if row["rank"] in flagged_ranks
                else ("rerun" if row["rank"] in verdict.rerun_wanted else "ok")
            )
            connection.execute(
                RESULT.update().where(RESULT.c.id == row["id"]).values(judged=True, verdict=verdict_of)
            )
        hardware = [f.rank for f in findings if f.rank is not None and f.evidence.get("persistent")]
        return touched, hardware

    def _golden(self, connection: Connection, stacks: set[str]) -> dict[tuple[str, str], KernelResult]:
        rows = connection.execute(sa.select(GOLDEN).where(GOLDEN.c.stack_key.in_(stacks))).mappings()
        return {
            (r["stack_key"], r["kernel"]): KernelResult(
                r["fingerprint"], tuple(r["summary"]), r["deterministic"]
            )
            for r in rows
        }

    def _keep_golden(
        self,
        connection: Connection,
        agreed: Mapping[tuple[str, str], str],
        results: Sequence[CanaryResult],
        run_id: int,
        now: float,
    ) -> None:
        for (stack, kernel), fingerprint in agreed.items():
            sample = next(
                r.kernels[kernel]
                for r in results
                if r.stack == stack and r.kernels.get(kernel) and r.kernels[kernel].fingerprint == fingerprint
            )
            exists = connection.execute(
                sa.select(GOLDEN.c.kernel).where(GOLDEN.c.stack_key == stack, GOLDEN.c.kernel == kernel)
            ).first()
            if exists is None:
                connection.execute(
                    GOLDEN.insert(),
                    {
                        "stack_key": stack,
                        "kernel": kernel,
                        "fingerprint": fingerprint,
                        "summary": list(sample.summary),
                        "deterministic": sample.deterministic,
                        "established_at": now,
                        "established_step": results[0].step,
                        "run_id": run_id,
                    },
                )

    def _last_good(self, connection: Connection, run_id: int, device: str | None, step: int) -> int:
        """The newest step at which this device's canary passed (0 if never): the fault may
        have touched training anywhere after it."""
        last = connection.execute(
            sa.select(sa.func.max(RESULT.c.step)).where(
                RESULT.c.run_id == run_id,
                RESULT.c.device_uuid == device,
                RESULT.c.verdict == "ok",
                RESULT.c.step < step,
            )
        ).scalar()
        return int(last or 0)

    def golden_payload(self, connection: Connection, run_id: int) -> dict[str, dict[str, str]]:
        """Golden fingerprints of the run's stacks, for the hooks' immediate re-run."""
        stacks = connection.execute(
            sa.select(RESULT.c.stack_key).where(RESULT.c.run_id == run_id).distinct()
        ).scalars()
        payload: dict[str, dict[str, str]] = defaultdict(dict)
        for (stack, kernel), result in self._golden(connection, set(stacks)).items():
            payload[stack][kernel] = result.fingerprint
        return dict(payload)

    # --- schedule ----------------------------------------------------------------------------

    def ensure_schedule(self, run_id: int) -> None:
        with self._engine.begin() as connection:
            if (
                connection.execute(sa.select(SCHEDULE.c.run_id).where(SCHEDULE.c.run_id == run_id)).first()
                is None
            ):
                connection.execute(
                    SCHEDULE.insert(),
                    {
                        "run_id": run_id,
                        "enabled": True,
                        "interval_s": None,
                        "budget_fraction": self._config.schedule.budget_fraction,
                        "last_issued_at": None,
                        "created_at": self._clock(),
                    },
                )

    def set_schedule(
        self,
        connection: Connection,
        run_id: int,
        enabled: bool,
        interval_s: float | None,
        budget_fraction: float | None,
    ) -> None:
        self.ensure_schedule(run_id)
        values: dict[str, Any] = {"enabled": enabled, "interval_s": interval_s}
        if budget_fraction is not None:
            values["budget_fraction"] = budget_fraction
        connection.execute(SCHEDULE.update().where(SCHEDULE.c.run_id == run_id).values(**values))

    def schedule_due(self, among: Collection[int] | None = None) -> list[int]:
        """Issue a canary directive to every run (of ``among``, when given) whose schedule is
        due; returns directive ids."""
        now = self._clock()
        issued = []
        query = sa.select(SCHEDULE).where(SCHEDULE.c.enabled.is_(True))
        if among is not None:
            query = query.where(SCHEDULE.c.run_id.in_(sorted(among)))
        with self._lock, self._engine.begin() as connection:
            for schedule in connection.execute(query).mappings():
                interval = self.interval_s(connection, schedule)
                if schedule["last_issued_at"] is not None and now - schedule["last_issued_at"] < interval:
                    continue
                if not self._running(connection, schedule["run_id"], now):
                    continue
                issued.append(self.issue(connection, schedule["run_id"], now, "schedule"))
        return issued

    def interval_s(self, connection: Connection, schedule: Any) -> float:
        if schedule["interval_s"] is not None:
            return float(schedule["interval_s"])
        # A round costs its slowest rank: synchronous training waits for it.
        seconds = (
            connection.execute(
                sa.select(sa.func.max(RESULT.c.seconds))
                .where(RESULT.c.run_id == schedule["run_id"], RESULT.c.seconds.is_not(None))
                .group_by(RESULT.c.incarnation, RESULT.c.step)
                .order_by(sa.func.max(RESULT.c.id).desc())
                .limit(16)
            )
            .scalars()
            .all()
        )
        suite = statistics.median(seconds) if seconds else 0.0
        config = replace(self._config.schedule, budget_fraction=schedule["budget_fraction"])
        return canary_interval_s(suite, config)

    def _running(self, connection: Connection, run_id: int, now: float) -> bool:
        newest = connection.execute(
            sa.select(sa.func.max(SUMMARY.c.last_time)).where(SUMMARY.c.run_id == run_id)
        ).scalar()
        return newest is not None and now - newest < 600

    def issue(self, connection: Connection, run_id: int, now: float, created_by: str) -> int:
        """A canary directive for every rank, at one step ahead of the newest reported."""
        step = directives.directive_step(connection, run_id, self._config.poll_interval_s, margin=2.0)
        directive_id = directives.create_directive(
            connection,
            run_id,
            "canary",
            created_by=created_by,
            now=now,
            act_at_step=step,
            payload={"golden": self.golden_payload(connection, run_id)},
        )
        connection.execute(SCHEDULE.update().where(SCHEDULE.c.run_id == run_id).values(last_issued_at=now))
        return directive_id

    def budget(self, connection: Connection, run_id: int) -> dict[str, Any]:
        """Seconds spent in canaries (the slowest rank of each round: synchronous training waits
        for it) against the run's training time."""
        per_round = connection.execute(
            sa.select(RESULT.c.step, sa.func.max(RESULT.c.seconds))
            .where(RESULT.c.run_id == run_id)
            .group_by(RESULT.c.incarnation, RESULT.c.step)
        ).all()
        span = connection.execute(
            sa.select(sa.func.min(SUMMARY.c.first_time), sa.func.max(SUMMARY.c.last_time)).where(
                SUMMARY.c.run_id == run_id
            )
        ).one()
        training = (span[1] - span[0]) if span[0] is not None and span[1] is not None else 0.0
        spent = sum(s for _, s in per_round)
        return {
            "rounds": len(per_round),
            "canary_seconds": spent,
            "training_seconds": training,
            "fraction": spent_fraction(spent, training),
        }
