"""A training log as printed (``.log``, Slurm's ``.out``): one row per line that names a step
and a signal, the way the common trainers print them, for ``runhealth backtest``.

- nanoGPT: ``iter 100: loss 2.3456, time 23.45ms, mfu 12.34%``
- Megatron-LM: ``iteration      100/  500000 | ... | learning rate: 1.000E-04 | ... | lm loss:
  7.123E+00 | loss scale: 65536.0 | grad norm: 1.234 | ...``
- torchtitan: ``step:  10  loss:  9.1234  memory: ...``; OLMo-style ``step=100 ... train/loss=2.3``
- modded-nanogpt: ``step:100/1750 train_loss:4.5 train_time:...`` (its ``logs/<run id>.txt``)
- llm.c's ``main.log``: ``s:100 trl:3.4915 lr:0.000355 norm:0.27`` (its own short names, read
  only in this shape: ``s:`` the step, ``trl:`` the training loss, ``norm:`` the grad norm;
  ``s:100 tel:...``, its validation loss, is no row)

A line is read when it names a step (``iter``, ``iteration``, ``step``, ``global_step``, the
first such number on it) and at least one of loss, grad norm, learning rate, loss scale (a
``name: value``, ``name=value`` or ``name value`` pair). Lines about evaluation (``val``,
``valid``, ``validation``, ``eval``, ``test``: nanoGPT's ``step 250: train loss ..., val loss
...``) are left out, so every step is a training step. Every value stays text here, as in the
other readers; ``backtest.convert`` types them and names a bad one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

NUMBER = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])|[-+]?(?:nan|inf(?:inity)?)\b)"
STEP = re.compile(r"(?:\b|_)(?:global[_ ]step|iteration|iter|step)\b\s*[:=#]?\s*(\d+)", re.IGNORECASE)
SIGNALS: dict[str, re.Pattern[str]] = {
    "loss": re.compile(r"\b(?:lm[ _]loss|train[/_ ]loss|loss)\b\s*[:=]?\s*" + NUMBER, re.IGNORECASE),
    "grad_norm": re.compile(r"\bgrad[ _-]?norm\b\s*[:=]?\s*" + NUMBER, re.IGNORECASE),
    "lr": re.compile(r"\b(?:learning[ _-]rate|lr)\b\s*[:=]?\s*" + NUMBER, re.IGNORECASE),
    "loss_scale": re.compile(r"\bloss[ _-]scale\b\s*[:=]?\s*" + NUMBER, re.IGNORECASE),
}
LLM_C = re.compile(
    r"^s:(\d+) trl:" + NUMBER + r"(?: lr:" + NUMBER + r")?(?: norm:" + NUMBER + r")?\s*$", re.IGNORECASE
)
"""llm.c's training line, whole: its names are too short to look for anywhere else."""
EVALUATION = re.compile(r"\b(?:val|valid|validation|eval|evaluation|test)\b", re.IGNORECASE)
LOG_SUFFIXES = (".log", ".out")


def line_row(line: str) -> dict[str, str] | None:
    """The step and signals one log line names, as text; ``None`` for any other line."""
    llm_c = LLM_C.match(line)
    if llm_c is not None:
        values = zip(("step", "loss", "lr", "grad_norm"), llm_c.groups(), strict=True)
        return {name: value for name, value in values if value is not None}
    if EVALUATION.search(line):
        return None
    step = STEP.search(line)
    if step is None:
        return None
    rest = line[: step.start()] + " " + line[step.end() :]  # the step's own number is no value
    row = {name: found.group(1) for name, pattern in SIGNALS.items() if (found := pattern.search(rest))}
    return {"step": step.group(1), **row} if row else None


def log_rows(path: Path) -> Iterator[dict[str, str]]:
    """Every training line of the log that names a step and a signal, in order."""
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            row = line_row(line)
            if row is not None:
                yield row
