"""Resume continuity: did a restart continue the run, or quietly start a different one?

The reference text's opening story: the weights survived, but the learning rate restarted
its warm-up and the data cursor went back to zero. Two sources of evidence:

- the series alone (``observe_continuity``): right after a restart, a loss that jumps back
  toward the run's untrained level means the weights were not restored; a learning rate
  back at its warm-up value means the schedule restarted; a data cursor far behind where the
  run was means the loader restarted.
- a resume record (``resume_findings``): what the trainer restored, compared with the
  checkpoint boundary it claims and with what the previous incarnation did next.

The data position is judged on what the trainer can restore: the consumed-example cursor, the
digest of a loader or sampler state it handed over, and the sample ids only when it declared its
data order deterministic (a trainer that draws at random after a restart draws other batches
however well it restored: the reference text's "exact replay demands strict control over ...
sample batching"). A resume whose data position nothing can check gets one note
(``data_order_note``), never a critical finding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.incidents import incident_kind
from policies.remedies import Remedy, kind_remedy, with_remedy
from policies.stats import MAD_TO_SIGMA, median
from policies.timelines import Timelines
from policies.types import Finding, Severity, StepPoint


@dataclass(frozen=True)
class ContinuityConfig:
    """Thresholds of the continuity checks.

    - ``untrained_fraction`` 0.5: the first window after a restart is back at least half way
      from the pre-restart level to the untrained level (the median of the run's first 5
      windows). A run restored correctly continues within its noise (the Pythia control's
      five restarts move the loss by under 1% of that gap); one restored without weights
      lands at the untrained level (fraction ~1).
      It is judged on each of the first ``resume_windows`` (5) windows after the restart,
      against the level of the timeline the run returned to (what the run had reached before
      the step it resumed at, whatever the abandoned steps did): a trainer may log one more
      normal row (the step it restored, or a loss computed before the load took effect) and
      jump on the next one, as two public pretraining runs that lost their state did.
    - The replayed-step rule: a restart onto steps the run had already logged (a resume from
      an older checkpoint after a crash, a rollback) is compared with what the run logged AT
      THOSE STEPS (``policies.timelines``): the median of its first ``resume_windows`` windows
      against the median of the same steps as logged by the timeline that went through the
      restart step (the one whose checkpoint it loaded), steps from that timeline's first spike
      or NaN on excluded (what a rollback abandons is no reference; too few left: not judged).
      A replay of the same batches from the same state logs the same losses. One that draws
      other batches differs by noise: the difference of two medians of n windows has a
      standard deviation of about s = sigma * sqrt(pi / n), sigma = 1.4826 ``step_mad`` of the
      run's last 100 windows before the restart (``Restart.noise``; fewer than 10: not judged).
      It is a ``broken_resume`` when the difference exceeds both:
      ``replay_noise_z`` 3.5 s: a Gaussian tail beyond 3.5 is 4.7e-4 per resume, and a run
      resumed every 200 steps (birdjepa's jobs were requeued every 160-265) resumes 500 times
      in 100,000 steps: 0.23 false incidents per 100,000 steps, within issue 16's target of 1
      (set from that target, not from the labelled resumes); and ``replay_shift`` 3% of the
      reference (0 turns the rule off): the development set's clean control has benign
      restarts whose first 5 windows sit +2.9% and +2.3% above the 5 before them (Pythia-410M
      at steps 3,001 and 4,001), and a loss logged smoothed has step noise far below the
      spread of two timelines. Measured on birdjepa (the added set, where the rule was
      developed): the resumes that moved the loss by 0.3 nats or more sit 4.0 to 48 s and
      3.8% to 144% off (1.15 to 13.8 times the threshold), those under 0.25 nats at most
      3.0 s (0.78 times).
    - ``replay_rows`` 4096: the loss of the run's last 4,096 logged rows is kept exactly (16
      bytes a row), so a rewind of up to that many rows is judged (birdjepa rewinds 32 to 53
      logged rows, the scenario trainer 20).
    - ``level_every`` 10, ``levels_kept`` 1024: the run's recent loss (the median of its last 5
      windows) is remembered every 10 steps for the last 1,024 of them (10,240 steps), so a
      restart onto a checkpoint older than the spike window (100 steps) is judged against the
      level the run had there.
    - ``min_progress`` 10%: the check needs the run to have trained (its loss at least 10%
      below the untrained level), else there is nothing to lose.
    - ``warmup_lr_ratio`` 2 and ``trained_lr_ratio`` 4: the learning rate after the restart
      is within 2x of the run's first (warm-up) value while before it was at least 4x that:
      a warm-up from lr/100 or from 0 clears both by far.
    - ``cursor_fraction`` 0.5: the consumed-example count after a restart is below half of
      what it was, while the optimizer step is not (a real rollback moves both together).
    - ``lr_relative_tolerance`` 1%: a restored learning rate further than this from what the
      previous incarnation used at the next step did not continue its phase.
    - ``param_state_fraction`` 1.0: the restored optimizer must hold state (moments, a step
      counter) for every trainable parameter it steps: AdamW creates it at a parameter's first
      update, so a checkpoint after step 1 has it for each one that ever had a gradient (the
      reference text: "optimizer state includes the first and second gradient moments alongside
      parameter step counters"). Lower it for a model with parameters that never get one.
    """

    initial_points: int = 5
    untrained_fraction: float = 0.5
    resume_windows: int = 5
    replay_shift: float = 0.03
    replay_noise_z: float = 3.5
    replay_rows: int = 4096
    level_every: int = 10
    levels_kept: int = 1024
    min_progress: float = 0.10
    warmup_lr_ratio: float = 2.0
    trained_lr_ratio: float = 4.0
    cursor_fraction: float = 0.5
    lr_relative_tolerance: float = 0.01
    param_state_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.initial_points < 1 or not 0 < self.untrained_fraction <= 1 or self.resume_windows < 1:
            raise ValueError(
                "ContinuityConfig: initial_points >= 1, 0 < untrained_fraction <= 1, resume_windows >= 1"
            )
        if self.warmup_lr_ratio >= self.trained_lr_ratio:
            raise ValueError("ContinuityConfig: warmup_lr_ratio must be below trained_lr_ratio")
        if not 0 < self.cursor_fraction < 1 or self.lr_relative_tolerance < 0:
            raise ValueError("ContinuityConfig: 0 < cursor_fraction < 1, lr_relative_tolerance >= 0")
        if not 0 < self.param_state_fraction <= 1:
            raise ValueError("ContinuityConfig: 0 < param_state_fraction <= 1")
        if self.replay_shift < 0 or self.replay_noise_z <= 0 or self.replay_rows < 1:
            raise ValueError("ContinuityConfig: replay_shift >= 0, replay_noise_z > 0, replay_rows >= 1")


@dataclass(frozen=True)
class Restart:
    """The newest restart, while its first windows are judged against what it returned to."""

    step: int
    level_before: float | None
    windows: int = 0
    """Windows judged since it, its first included."""
    flagged: bool = False
    replayed: bool = False
    """It went back to steps the run had logged: they can be compared with what it logged."""
    noise: float = 0.0
    """The run's step-to-step loss noise before the restart (robust: ``step_mad``)."""
    losses: tuple[float, ...] = ()
    steps: tuple[int, ...] = ()
    """The step of each of ``losses``."""


@dataclass(frozen=True)
class ContinuityState:
    initial_losses: tuple[float, ...] = ()
    first_lr: float | None = None
    previous: StepPoint | None = None
    restart: Restart | None = None
    levels: tuple[tuple[int, float], ...] = ()
    """(step, the loss level before it), every ``level_every`` steps: what a restart onto an
    earlier step returns to when the spike window only holds the abandoned steps."""
    history: Timelines = field(default_factory=Timelines)
    """The loss of the last ``replay_rows`` logged rows, exactly, by timeline: what a replay
    of logged steps is compared with."""


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _finding(
    point: StepPoint,
    kind: str,
    signal: str,
    value: float | None,
    threshold: float | None,
    message: str,
    **evidence: Any,
) -> Finding:
    return Finding(
        step=point.step,
        kind=kind,
        severity=Severity.CRITICAL,
        signal=signal,
        value=value,
        threshold=threshold,
        message=message,
        incarnation=point.incarnation,
        attempt=point.attempt,
        evidence=evidence,
    )


def observe_continuity(
    state: ContinuityState,
    point: StepPoint,
    level_before: float | None,
    config: ContinuityConfig,
    recent: float | None = None,
    noise: float = 0.0,
) -> tuple[ContinuityState, tuple[Finding, ...]]:
    """Judge a restart's first windows; ``level_before`` is the loss level the run had reached
    (its trailing median), ``recent`` the loss of its last few windows (remembered by step)."""
    initial = state.initial_losses
    if len(initial) < config.initial_points and _finite(point.loss) and not point.restart:
        initial = (*initial, point.loss)  # type: ignore[arg-type]
    first_lr = (
        state.first_lr
        if state.first_lr is not None
        else (point.lr if _finite(point.lr) and point.lr else None)
    )
    found: tuple[Finding, ...] = ()
    restart = state.restart
    history = _remembered(state.history, point, config)
    if point.restart and state.previous is not None:
        replayed = point.step <= state.previous.step
        restart = Restart(point.step, level_before, replayed=replayed, noise=noise)
        found = _restarted_schedule(point, state.previous, first_lr, config) + _reset_cursor(
            point, state.previous, config
        )
    if restart is not None and not restart.flagged and restart.windows < config.resume_windows:
        restart, lost, history = _restart_window(restart, point, initial, history, config)
        found = lost + found
    levels = state.levels
    # A timeline found broken is no reference for the level a later restart onto the same
    # steps is judged against (each broken resume of one checkpoint is named).
    # Nor is a window whose loss is not finite: a run gone NaN stops moving its window, and a
    # level remembered for its steps would be the one from before the NaN.
    broken = (restart is not None and restart.flagged) or not _finite(point.loss)
    if not point.restart and recent is not None and not broken and _level_due(levels, point.step, config):
        levels = (*levels, (point.step, recent))[-config.levels_kept :]
    return ContinuityState(initial, first_lr, point, restart, levels, history), found


def _remembered(history: Timelines, point: StepPoint, config: ContinuityConfig) -> Timelines:
    """The exact history with this point's loss; a restart begins a new timeline."""
    history = history.begin(point.step) if point.restart else history
    loss = point.loss
    return (
        history.push(point.step, loss, config.replay_rows)
        if loss is not None and math.isfinite(loss)
        else history
    )


def _restart_window(
    restart: Restart,
    point: StepPoint,
    initial: tuple[float, ...],
    history: Timelines,
    config: ContinuityConfig,
) -> tuple[Restart, tuple[Finding, ...], Timelines]:
    """One of a restart's first windows: weights lost, or a replay of logged steps away from
    what the run logged at them."""
    loss = point.loss
    if loss is not None and math.isfinite(loss):
        restart = replace(restart, losses=(*restart.losses, loss), steps=(*restart.steps, point.step))
    restart = replace(restart, windows=restart.windows + 1)
    lost = _lost_weights(point, initial, restart, config) or _replay_moved(point, restart, history, config)
    if not lost:
        return restart, (), history
    # The spikes of its first windows were this broken resume: the timeline it began is what
    # the run goes on from, and a later resume of its checkpoints replays it.
    return replace(restart, flagged=True), lost, history.uncut()


def after_findings(state: ContinuityState, findings: Iterable[Finding]) -> ContinuityState:
    """The findings about the current step (the series' own and any other policy's): from the
    first one a rollback answers (a spike, a NaN, a device: why a rollback abandons the steps),
    the current timeline's steps are no reference for a replay of them. A broken resume is
    not one: the timeline it found is what the run went on from, and the checkpoints it saved
    are what a later resume of them loads."""
    steps = [f.step for f in findings if _abandoned_from(f)]
    return replace(state, history=state.history.cut(min(steps))) if steps else state


def _abandoned_from(finding: Finding) -> bool:
    kind = incident_kind(finding.kind)
    return kind != "broken_resume" and kind_remedy(kind) is Remedy.ROLLBACK


def _level_due(levels: tuple[tuple[int, float], ...], step: int, config: ContinuityConfig) -> bool:
    return not levels or step - levels[-1][0] >= config.level_every or step < levels[-1][0]


def level_at(state: ContinuityState, step: int) -> float | None:
    """The loss level the run had before ``step``, as remembered (None: nothing that early)."""
    return next((level for at, level in reversed(state.levels) if at <= step), None)


def at_restart(state: ContinuityState, step: int, config: ContinuityConfig) -> Restart | None:
    """The restart a change that began at ``step`` began at: within its first
    ``resume_windows`` steps (a level shift there is a broken resume, not a shape)."""
    restart = state.restart
    if restart is None or not restart.step <= step < restart.step + config.resume_windows:
        return None
    return restart


def lost_weights_detected(findings: Sequence[Finding]) -> bool:
    return any(f.kind == "broken_resume" for f in findings)


def _lost_weights(
    point: StepPoint,
    initial: tuple[float, ...],
    restart: Restart,
    config: ContinuityConfig,
) -> tuple[Finding, ...]:
    level_before = restart.level_before
    if not initial or level_before is None or not _finite(point.loss):
        return ()
    untrained = median(initial)
    gap = untrained - level_before
    # ``<=``: a loss that starts and stays at 0 made no progress either (0 < 0 is false).
    if gap <= 0 or gap < config.min_progress * abs(untrained):
        return ()
    back = (point.loss - level_before) / gap  # type: ignore[operator]
    if back < config.untrained_fraction:
        return ()
    later = "" if point.step == restart.step else f" at step {point.step}"
    # Past the untrained level (its first windows had already learned a little): say so plainly.
    where = (
        f"above the run's first logged level {untrained:.4g} (its trailing median before the "
        f"restart: {level_before:.4g})"
        if back > 1
        else f"{back:.0%} of the way back from {level_before:.4g} to the untrained {untrained:.4g}"
    )
    finding = _finding(
        point,
        "broken_resume",
        "loss",
        point.loss,
        level_before + config.untrained_fraction * gap,
        f"after the restart at step {restart.step} the loss is {point.loss:.4g}{later}, {where}: the "
        "weights were lost or not loaded",
        untrained=untrained,
        level_before=level_before,
        fraction=back,
        restart_step=restart.step,
    )
    return (replace(finding, step=restart.step),)


def _replay_moved(
    point: StepPoint, restart: Restart, history: Timelines, config: ContinuityConfig
) -> tuple[Finding, ...]:
    """A restart onto steps the run had already logged, whose first ``resume_windows`` windows
    sit away from what the run logged at the same steps by more than noise and the relative
    floor (``ContinuityConfig``): it did not resume from the state the run had there."""
    windows = config.resume_windows
    if (
        config.replay_shift <= 0
        or not restart.replayed
        or restart.noise <= 0
        or len(restart.losses) != windows
    ):
        return ()
    reference = history.reference(restart.step, restart.steps)
    if reference is None:
        return ()
    level, before = median(restart.losses), median(reference)
    allowed = replay_allowance(before, restart.noise, windows, config)
    if abs(level - before) <= allowed:
        return ()
    shift = (level - before) / abs(before)
    finding = _finding(
        point,
        "broken_resume",
        "loss",
        level,
        before + math.copysign(allowed, level - before),
        f"after the restart onto step {restart.step}, which the run had trained through, the loss "
        f"sits at {level:.4g} over {windows} windows where the run had {before:.4g} at the same "
        f"steps ({shift:+.1%}, {abs(level - before) / allowed:.1f}x what noise allows): it did "
        "not resume from the state it had there",
        level_before=before,
        shift=shift,
        allowed=allowed,
        restart_step=restart.step,
        judged_at_step=point.step,
    )
    return (replace(finding, step=restart.step),)


def replay_allowance(reference: float, noise: float, windows: int, config: ContinuityConfig) -> float:
    """How far the median of ``windows`` replayed windows may sit from the median of the same
    steps as the run logged them before: ``replay_noise_z`` standard deviations of the
    difference of two such medians (``noise`` is a ``step_mad``), or ``replay_shift`` of the
    reference, whichever is larger."""
    spread = MAD_TO_SIGMA * noise * math.sqrt(math.pi / windows)
    return max(config.replay_noise_z * spread, config.replay_shift * abs(reference))


def level_shift_at_restart(finding: Finding, restart: Restart) -> Finding:
    """A level shift that began at a restart, named for what it is: a broken resume."""
    return replace(
        finding,
        step=restart.step,
        kind="broken_resume",
        severity=Severity.CRITICAL,
        message=(
            f"the loss moved to a new level at the restart at step {restart.step} and stayed there "
            f"({finding.message}): a resume that restored the run continues its level, so what was "
            "loaded is not what was saved"
        ),
        evidence={**finding.evidence, "restart_step": restart.step, "shape": "level_shift"},
    )


def _restarted_schedule(
    point: StepPoint, previous: StepPoint, first_lr: float | None, config: ContinuityConfig
) -> tuple[Finding, ...]:
    if first_lr is None or not (_finite(point.lr) and _finite(previous.lr)):
        return ()
    assert point.lr is not None and previous.lr is not None
    if previous.lr < config.trained_lr_ratio * first_lr or point.lr > config.warmup_lr_ratio * first_lr:
        return ()
    return (
        _finding(
            point,
            "schedule_restarted",
            "lr",
            point.lr,
            previous.lr,
            f"the learning rate fell from {previous.lr:.4g} to {point.lr:.4g} at the restart "
            f"(step {point.step}), back to its warm-up value {first_lr:.4g}: the scheduler "
            "state was not restored",
            first_lr=first_lr,
        ),
    )


def _reset_cursor(point: StepPoint, previous: StepPoint, config: ContinuityConfig) -> tuple[Finding, ...]:
    if point.consumed is None or previous.consumed is None or previous.consumed <= 0:
        return ()
    cursor_back = point.consumed < config.cursor_fraction * previous.consumed
    step_kept = point.step >= config.cursor_fraction * previous.step
    if not (cursor_back and step_kept):
        return ()
    return (
        _finding(
            point,
            "data_cursor_reset",
            "consumed",
            float(point.consumed),
            float(previous.consumed),
            f"the data cursor went from {previous.consumed} to {point.consumed} consumed examples "
            f"at the restart while the step went {previous.step} -> {point.step}: the loader "
            "restarted instead of resuming",
        ),
    )


@dataclass(frozen=True)
class ResumeFacts:
    """What a restart restored on one rank (a resume record's ``restored`` dict, typed)."""

    incarnation: str
    rank: int
    checkpoint_step: int | None
    optimizer_step: int | None = None
    exp_avg_norm: float | None = None
    exp_avg_sq_norm: float | None = None
    lr: float | None = None
    scheduler_last_epoch: int | None = None
    consumed: int | None = None
    first_sample_ids: tuple[Any, ...] | None = None
    param_states: int | None = None
    """Parameters the restored optimizer holds state for."""
    trainable_params: int | None = None
    """Parameters in the optimizer's groups that take gradients."""
    deterministic_data: bool = False
    """The trainer declared its data order reproducible: the same batches follow a checkpoint
    every time it is restored (a fixed order, a seeded sampler fast-forwarded to the cursor)."""
    data_state_digest: str | None = None
    """sha256 of the loader or sampler state the trainer restored (``StatefulDataLoader``'s
    ``state_dict()``, a sampler's state)."""

    @property
    def data_position_checkable(self) -> bool:
        """Whether the batches after the resume can be told to be the ones that follow the
        checkpoint: declared deterministic, or a restored data state to compare."""
        return self.deterministic_data or self.data_state_digest is not None


@dataclass(frozen=True)
class Expected:
    """What the checkpoint and the previous incarnation say the resume should restore."""

    step: int
    consumed: int | None = None
    next_lr: float | None = None
    """The learning rate the previous incarnation used for the window after ``step``."""
    next_sample_ids: tuple[Any, ...] | None = None
    """The sample ids this rank saw in the window after ``step``, before the restart."""
    data_state_digest: str | None = None
    """The data-state digest an earlier resume of this checkpoint restored on this rank."""
    after_rollback: int | None = None
    """The rollback (its proposal) whose restore this resume is: what it finds, the restore a
    rollback runs did, and another rollback would do again."""


Problem = tuple[str, str, float | None, float | None, str]

NOT_REPRODUCIBLE = "data order is not reproducible: continuity of the data position cannot be checked"


def resume_findings(facts: ResumeFacts, expected: Expected, config: ContinuityConfig) -> tuple[Finding, ...]:
    """Each piece of state this rank's resume did not restore; after a rollback, each says a
    rollback is not its remedy."""
    problems = (
        _optimizer_problems(facts, expected, config)
        + _schedule_problems(facts, expected, config)
        + _data_problems(facts, expected)
    )
    findings = tuple(
        Finding(
            step=expected.step + 1,
            kind=kind,
            severity=Severity.CRITICAL,
            signal=signal,
            value=value,
            threshold=threshold,
            message=f"rank {facts.rank}: {message}",
            incarnation=facts.incarnation,
            rank=facts.rank,
            evidence={"checkpoint_step": expected.step},
        )
        for kind, signal, value, threshold, message in problems
    )
    if expected.after_rollback is None:
        return findings
    why = (
        f"the resume of rollback proposal {expected.after_rollback}: another rollback restores "
        "through the same code, so the trainer's restore must change"
    )
    return tuple(with_remedy(finding, Remedy.FIX_RESTORE, why) for finding in findings)


def _optimizer_problems(facts: ResumeFacts, expected: Expected, config: ContinuityConfig) -> list[Problem]:
    """Lost optimizer or schedule state, whatever the learning rate says."""
    problems: list[Problem] = []
    if expected.step > 0:
        if (
            facts.param_states is not None
            and facts.trainable_params
            and facts.param_states < config.param_state_fraction * facts.trainable_params
        ):
            problems.append(
                (
                    "optimizer_state_lost",
                    "param_states",
                    float(facts.param_states),
                    float(facts.trainable_params),
                    f"the optimizer holds {facts.trainable_params} trainable parameters but restored "
                    f"state (moments, step counters) for {facts.param_states}",
                )
            )
        if facts.optimizer_step == 0:
            problems.append(
                (
                    "optimizer_state_lost",
                    "optimizer_step",
                    0.0,
                    float(expected.step),
                    f"optimizer step counter restored as 0 for a checkpoint at step {expected.step}",
                )
            )
        zero_moments = [n for n in ("exp_avg_norm", "exp_avg_sq_norm") if getattr(facts, n) == 0]
        if zero_moments:
            problems.append(
                (
                    "optimizer_state_lost",
                    zero_moments[0],
                    0.0,
                    None,
                    f"Adam moments restored with zero norm ({', '.join(zero_moments)})",
                )
            )
    return problems


def _schedule_problems(facts: ResumeFacts, expected: Expected, config: ContinuityConfig) -> list[Problem]:
    problems: list[Problem] = []
    if expected.step > 0 and facts.scheduler_last_epoch == 0:
        problems.append(
            (
                "schedule_restarted",
                "scheduler_last_epoch",
                0.0,
                float(expected.step),
                "scheduler restored at epoch 0: warm-up starts over",
            )
        )
    if expected.next_lr is not None and _finite(facts.lr) and expected.next_lr > 0:
        assert facts.lr is not None
        if abs(facts.lr - expected.next_lr) > config.lr_relative_tolerance * expected.next_lr:
            problems.append(
                (
                    "schedule_restarted",
                    "lr",
                    facts.lr,
                    expected.next_lr,
                    f"learning rate restored as {facts.lr:.6g}; the run used {expected.next_lr:.6g} "
                    "after this checkpoint",
                )
            )
    return problems


def _data_problems(facts: ResumeFacts, expected: Expected) -> list[Problem]:
    """The data position, on what the trainer can restore: the cursor always, the data state
    when an earlier restore of this checkpoint gave one, the sample ids only when declared
    deterministic."""
    problems: list[Problem] = []
    if expected.consumed is not None and facts.consumed is not None and facts.consumed != expected.consumed:
        kind = "data_cursor_reset" if facts.consumed == 0 else "data_cursor_mismatch"
        problems.append(
            (
                kind,
                "consumed",
                float(facts.consumed),
                float(expected.consumed),
                f"data cursor restored at {facts.consumed} consumed examples; the checkpoint "
                f"says {expected.consumed}",
            )
        )
    if (
        facts.data_state_digest is not None
        and expected.data_state_digest is not None
        and facts.data_state_digest != expected.data_state_digest
    ):
        problems.append(
            (
                "data_cursor_mismatch",
                "data_state",
                None,
                None,
                f"data state restored as {facts.data_state_digest[:12]}; an earlier restore of this "
                f"checkpoint gave {expected.data_state_digest[:12]}",
            )
        )
    if (
        facts.deterministic_data
        and expected.next_sample_ids is not None
        and facts.first_sample_ids is not None
        and facts.first_sample_ids != expected.next_sample_ids[: len(facts.first_sample_ids)]
    ):
        problems.append(
            (
                "data_cursor_mismatch",
                "sample_ids",
                None,
                None,
                f"first samples after the resume {list(facts.first_sample_ids)[:4]} are not the "
                f"ones that followed the checkpoint {list(expected.next_sample_ids)[:4]}",
            )
        )
    return problems


def data_order_note(facts: Sequence[ResumeFacts], checkpoint_step: int) -> Finding | None:
    """One note for a resume (all its ranks) whose data position nothing can check: no rank
    declared its data order deterministic or handed over its data state. Info: it opens no
    incident and proposes nothing (a rollback cannot make random draws repeat)."""
    unchecked = sorted(f.rank for f in facts if not f.data_position_checkable)
    if not unchecked:
        return None
    return Finding(
        step=checkpoint_step + 1,
        kind="data_order_not_reproducible",
        severity=Severity.INFO,
        signal="sample_ids",
        value=None,
        threshold=None,
        message=NOT_REPRODUCIBLE,
        incarnation=facts[0].incarnation,
        evidence={
            "checkpoint_step": checkpoint_step,
            "ranks": len(unchecked),
            "first_ranks": unchecked[:16],
            "cursor_checked": any(f.consumed is not None for f in facts),
            "to_check_it": "rh.resumed(deterministic_data=True) or rh.resumed(data_state=...)",
        },
    )


__all__ = [
    "NOT_REPRODUCIBLE",
    "ContinuityConfig",
    "ContinuityState",
    "Expected",
    "Restart",
    "ResumeFacts",
    "after_findings",
    "at_restart",
    "data_order_note",
    "level_at",
    "level_shift_at_restart",
    "lost_weights_detected",
    "observe_continuity",
    "replay_allowance",
    "resume_findings",
]
