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
- fairseq: ``| train_inner | epoch 001:    100 / 1000 loss=7.123, ..., num_updates=100, lr=...,
  gnorm=1.2, loss_scale=8, ...`` (``--log-format simple``; ``num_updates`` the step, ``gnorm`` the
  grad norm), and ``--log-format json``'s ``| train_inner | {"epoch": 1, ..., "loss": "7.123",
  ..., "num_updates": "100", "lr": ..., "gnorm": ...}``; its epoch averages (``| train |``) and
  validations (``| valid |``) are no rows
- MMEngine (XTuner, MMDetection, MMSegmentation): ``- mmengine - INFO - Iter(train) [ 10/720]
  lr: 9.0001e-05  eta: ...  loss: 2.6900  grad_norm: 0.9361``, or ``Epoch(train) [2][ 50/1175]``
  (step 1225); ``Iter(val)``, ``Epoch(val)`` lines are no rows
- DeepSpeed's pipeline engine: ``steps: 100 loss: 0.0585 iter time (s): 0.186 samples/sec: ...``
- a dict printed whole at the end of a line (``dict_row``): the Hugging Face Trainer's
  ``{'loss': 2.3456, 'grad_norm': 1.23, 'learning_rate': 4.9e-05, 'epoch': 0.01}``, with any
  prefix (``0: `` from ``srun --label``, a logger's); it names no step, so its steps are counted
  (``log_rows``) unless one is named before it on its line; ``eval_*`` dicts and the closing
  ``train_runtime`` one are no rows

A line is read when it names a step (``iter``, ``iteration``, ``step``, ``global_step``,
``num_updates``, the first such number on it) and at least one of loss, grad norm, learning rate, loss scale (a
``name: value``, ``name=value`` or ``name value`` pair). Lines about evaluation (``val``,
``valid``, ``validation``, ``eval``, ``test``: nanoGPT's ``step 250: train loss ..., val loss
...``) are left out, so every step is a training step. Every value stays text here, as in the
other readers; ``backtest.convert`` types them and names a bad one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NUMBER = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])|[-+]?(?:nan|inf(?:inity)?)\b)"
STEP = re.compile(
    r"(?:\b|_)(?:global[_ ]step|num_updates|iteration|iter|step)\b\s*[:=#]?\s*(\d+)", re.IGNORECASE
)
SIGNALS: dict[str, re.Pattern[str]] = {
    "loss": re.compile(r"\b(?:lm[ _]loss|train[/_ ]loss|loss)\b\s*[:=]?\s*" + NUMBER, re.IGNORECASE),
    "grad_norm": re.compile(r"\b(?:grad[ _-]?norm|gnorm)\b\s*[:=]?\s*" + NUMBER, re.IGNORECASE),
    "lr": re.compile(r"\b(?:learning[ _-]rate|lr)\b\s*[:=]?\s*" + NUMBER, re.IGNORECASE),
    "loss_scale": re.compile(r"\bloss[ _-]scale\b\s*[:=]?\s*" + NUMBER, re.IGNORECASE),
}
LLM_C = re.compile(
    r"^s:(\d+) trl:" + NUMBER + r"(?: lr:" + NUMBER + r")?(?: norm:" + NUMBER + r")?\s*$", re.IGNORECASE
)
"""llm.c's training line, whole: its names are too short to look for anywhere else."""
DEEPSPEED_PIPELINE = re.compile(r"^(?:\d+:\s*)?steps: (\d+) loss: " + NUMBER)
"""DeepSpeed's pipeline engine (``PipelineEngine.train_batch``): ``steps: 100 loss: 0.0585 iter
time (s): ...``, at the start of the line (after ``srun --label``'s ``0: ``). Only in this shape:
``steps`` anywhere would read ``warmup_steps=500`` in an arguments dump as a step."""
EVALUATION = re.compile(r"\b(?:val|valid|validation|eval|evaluation|test)\b", re.IGNORECASE)
EPOCH_AVERAGES = re.compile(r"\|\s*train\s*\|")
"""fairseq's end-of-epoch line, logged under ``train`` (its steps' lines under ``train_inner``)."""
LOG_SUFFIXES = (".log", ".out")

MMENGINE = re.compile(r"\b(?:Iter\(train\)|Epoch\(train\)\s*\[(\d+)\])\s*\[\s*(\d+)\s*/\s*(\d+)\]")
"""MMEngine's LogProcessor (XTuner, MMDetection, MMSegmentation): ``Iter(train) [ 10/720]``, the
step; ``Epoch(train) [2][ 50/1175]``, the 50th iteration of epoch 2: step 1175 + 50."""
PRINTED_DICT = re.compile(r"\{([^{}]*)\}\s*$")
"""A dict printed whole at the end of a line, Python's repr or JSON."""
DICT_PAIR = re.compile(r"""['"]([^'"]+)['"]\s*:\s*('[^']*'|"[^"]*"|[^,]+)""")
TENSOR = re.compile(r"^tensor\(\s*" + NUMBER)
"""A value printed as a torch tensor, as transformers printed ``grad_norm`` for a while."""
DICT_STEPS = ("step", "global_step", "num_updates", "iteration", "iter", "global_step/max_steps")
"""Keys of a dict's step; a value ``5/100`` (ms-swift's ``global_step/max_steps``) is step 5."""
DICT_FIELDS = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "gnorm": "grad_norm",
    "learning_rate": "lr",
    "lr": "lr",
    "loss_scale": "loss_scale",
}
"""A dict's keys read as fields: the Trainer's and fairseq's names. Not ``train_loss``: the
Trainer's closing dict has it as the run's mean, fairseq's epoch line as the epoch's."""
DICT_NOT_TRAINING = ("eval_", "valid_", "test_", "predict_", "train_runtime")


def line_row(line: str) -> dict[str, str] | None:
    """The step and signals one log line names, as text; ``None`` for any other line. A printed
    dict that names no step (the Trainer's) is a row without one."""
    llm_c = LLM_C.match(line)
    if llm_c is not None:
        values = zip(("step", "loss", "lr", "grad_norm"), llm_c.groups(), strict=True)
        return {name: value for name, value in values if value is not None}
    pipeline = DEEPSPEED_PIPELINE.match(line)
    if pipeline is not None:
        return {"step": pipeline.group(1), "loss": pipeline.group(2)}
    if EVALUATION.search(line) or EPOCH_AVERAGES.search(line):
        return None
    printed = PRINTED_DICT.search(line)
    if printed is not None and (row := dict_row(printed.group(1))) is not None:
        named = STEP.search(line, 0, printed.start()) if "step" not in row else None
        return {"step": named.group(1), **row} if named is not None else row  # "Step 100: {...}"
    mmengine = MMENGINE.search(line)
    if mmengine is not None:
        epoch, index, length = mmengine.groups()
        number = index if epoch is None else str((int(epoch) - 1) * int(length) + int(index))
        return _signals(number, line[mmengine.end() :])
    step = STEP.search(line)
    if step is None:
        return None
    rest = line[: step.start()] + " " + line[step.end() :]  # the step's own number is no value
    return _signals(step.group(1), rest)


def _signals(step: str, rest: str) -> dict[str, str] | None:
    """The step and the signals named in the rest of its line; ``None`` when there are none."""
    row = {name: found.group(1) for name, pattern in SIGNALS.items() if (found := pattern.search(rest))}
    return {"step": step, **row} if row else None


def dict_row(body: str) -> dict[str, str] | None:
    """The step and signals of a printed dict's body (``'loss': 2.3, 'epoch': 0.1``); ``None``
    for an evaluation's or the closing summary's, or one with no signal. Without a step key it
    is a row only when it names an ``epoch``, as every dict the Trainer logs does."""
    pairs = {key.strip(): value.strip().strip("'\"").strip() for key, value in DICT_PAIR.findall(body)}
    if not pairs or any(key.startswith(DICT_NOT_TRAINING) for key in pairs):
        return None
    row = {}
    for key, field in DICT_FIELDS.items():
        if field not in row and key in pairs and (number := _number(pairs[key])) is not None:
            row[field] = number
    step = next((pairs[key].split("/")[0].strip() for key in DICT_STEPS if key in pairs), None)
    if not row or (step is None and "epoch" not in pairs):
        return None
    if step is None:
        return row
    return {"step": step, **row} if step.isdigit() else None


def _number(text: str) -> str | None:
    """The text if it is one number (or a tensor of one: ``tensor(1.2, device='cuda:0')``)."""
    tensor = TENSOR.match(text)
    if tensor is not None:
        return tensor.group(1)
    return text if re.fullmatch(NUMBER, text, re.IGNORECASE) else None


@dataclass
class LogSteps:
    """What reading a log found: how many of its rows had their step counted, not named."""

    counted: int = 0


def log_rows(path: Path, steps: LogSteps | None = None) -> Iterator[dict[str, str]]:
    """Every training line of the log that names a step and a signal, in order. A row whose
    line names no step (the Trainer's printed dicts) is numbered by its order among those:
    1, 2, 3, ..., one per ``logging_steps``; ``steps`` counts them."""
    counted = 0
    with path.open(encoding="utf-8") as lines:  # universal newlines: a tqdm bar's \r ends a line
        for line in lines:
            row = line_row(line)
            if row is None:
                continue
            if "step" not in row:
                counted += 1
                row = {"step": str(counted), **row}
                if steps is not None:
                    steps.counted = counted
            yield row
