"""Training logs as printed (``monitor/judge/log_lines.py``): the lines of nanoGPT, Megatron-LM,
torchtitan and OLMo-style loggers read as rows, evaluation lines left out, and a log read by
``runhealth backtest`` as its CSV would be."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from monitor.judge.backtest import BacktestError, backtest, load_series, report_json
from monitor.judge.log_lines import line_row
from policies.series import SeriesConfig

MEGATRON = (
    " iteration      100/  500000 | consumed samples:        51200 | elapsed time per iteration (ms): "
    "1234.5 | learning rate: 1.000E-04 | global batch size:   512 | lm loss: 7.123E+00 | loss scale: "
    "65536.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)


@pytest.mark.parametrize(
    ("line", "row"),
    [
        ("iter 100: loss 2.3456, time 23.45ms, mfu 12.34%", {"step": "100", "loss": "2.3456"}),
        (
            MEGATRON,
            {
                "step": "100",
                "loss": "7.123E+00",
                "grad_norm": "1.234",
                "lr": "1.000E-04",
                "loss_scale": "65536.0",
            },
        ),
        ("step:  10  loss:  9.1234  memory: 12.3GiB(40%)  tps: 1234", {"step": "10", "loss": "9.1234"}),
        ("[step=100/739328] train/loss=2.3 lr=0.0003", {"step": "100", "loss": "2.3", "lr": "0.0003"}),
        ("iter 7: loss nan, time 3ms", {"step": "7", "loss": "nan"}),
        ("global_step 5 loss=inf", {"step": "5", "loss": "inf"}),
        ("step 3 | loss scale: 1024.0 | lm loss: 2.0", {"step": "3", "loss": "2.0", "loss_scale": "1024.0"}),
        ("step 250: train loss 1.2345, val loss 1.3456", None),  # nanoGPT's evaluation line
        (" validation loss at iteration 100 | lm loss value: 6.9 |", None),
        ("step 12 saved checkpoint to out/ckpt.pt", None),  # a step and no signal
        ("{'loss': 2.345, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.1}", None),  # no step
        ("loading 4 steps of warmup", None),
        # llm.c's main.log: s: is the step, trl: the training loss, norm: the grad norm
        (
            "s:9025 trl:3.4915 lr:0.000355 norm:2.02",
            {"step": "9025", "loss": "3.4915", "lr": "0.000355", "grad_norm": "2.02"},
        ),
        ("s:12 trl:9.350030", {"step": "12", "loss": "9.350030"}),
        ("s:250 tel:4.1203", None),  # llm.c's validation loss
        ("s:250 eval:0.2941", None),  # llm.c's HellaSwag accuracy
        # modded-nanogpt
        (
            "step:20343/20344 train_loss:2.4984 train_time:34638583ms step_avg:1703.56ms",
            {"step": "20343", "loss": "2.4984"},
        ),
        ("step:20250/20344 val_loss:2.7741 train_time:34480530ms step_avg:1703.58ms", None),
    ],
)
def test_each_trainers_line_is_read_as_its_step_and_signals(line: str, row: dict[str, str] | None) -> None:
    assert line_row(line) == row


def report(path: Path) -> dict:
    loaded = load_series(path, {}, None)
    return report_json(backtest(loaded, SeriesConfig()), loaded.notes, path)


def test_a_nanogpt_log_is_judged_as_the_same_series_in_a_csv(tmp_path: Path) -> None:
    losses = [3.0 - s * 0.001 + 0.01 * ((s * 7) % 5 - 2) for s in range(1, 301)]
    losses[199] = 9.0  # step 200
    lines = ["Overriding config with config/train_shakespeare_char.py", "number of parameters: 10.65M"]
    for step, loss in enumerate(losses, 1):
        if step % 100 == 0:
            lines.append(f"step {step}: train loss {loss:.4f}, val loss {loss + 0.1:.4f}")
        lines.append(f"iter {step}: loss {loss:.4f}, time 23.45ms, mfu 12.34%")
    (tmp_path / "train.log").write_text("\n".join(lines) + "\n")
    pl.DataFrame({"step": range(1, 301), "loss": [round(v, 4) for v in losses]}).write_csv(tmp_path / "s.csv")
    from_log, from_csv = report(tmp_path / "train.log"), report(tmp_path / "s.csv")
    assert from_log["steps"] == 300
    assert from_log["incidents"] == from_csv["incidents"]
    assert [(i["kind"], i["first_step"]) for i in from_log["incidents"]] == [("spike", 200)]
    assert json.dumps(from_log["findings"]) == json.dumps(from_csv["findings"])


def test_a_log_with_no_training_line_is_one_line_and_a_value_that_is_no_number_is_no_row(
    tmp_path: Path,
) -> None:
    (tmp_path / "empty.out").write_text("srun: job 123 queued\nhello\n")
    with pytest.raises(BacktestError, match="no line names a step and a loss"):
        report(tmp_path / "empty.out")
    (tmp_path / "odd.log").write_text("iter 1: loss 2.0\niter 2: loss 2.1.3\niter 3: loss 2.0\n")
    assert report(tmp_path / "odd.log")["steps"] == 2  # "2.1.3" is not read as 2.1


def test_a_txt_training_log_is_read_as_a_log_and_a_txt_table_as_a_table(tmp_path: Path) -> None:
    """modded-nanogpt writes ``logs/<run id>.txt``: the training script's source, then one
    ``step:N/T train_loss:...`` line a step. Read as a CSV it was refused ("no 'step' column")."""
    losses = [3.0 - s * 0.001 + 0.01 * ((s * 7) % 5 - 2) for s in range(1, 301)]
    losses[199] = 9.0  # step 200
    lines = [
        "import os",
        "import sys",
        "with open(sys.argv[0]) as f:",
        "    code = f.read() # read the code, a, b",
    ]
    lines.append('        print(f"step:{step+1}/{args.num_iterations} train_loss:{train_loss.item():.4f}")')
    for step, loss in enumerate(losses, 1):
        if step % 100 == 0:
            lines.append(
                f"step:{step}/300 val_loss:{loss + 0.1:.4f} train_time:{step * 90}ms step_avg:90.00ms"
            )
        lines.append(f"step:{step}/300 train_loss:{loss:.4f} train_time:{step * 90}ms step_avg:90.00ms")
    (tmp_path / "0ecdb695.txt").write_text("\n".join(lines) + "\n")
    table = pl.DataFrame({"step": range(1, 301), "loss": [round(v, 4) for v in losses]})
    table.write_csv(tmp_path / "s.txt")
    from_log, from_table = report(tmp_path / "0ecdb695.txt"), report(tmp_path / "s.txt")
    assert from_log["steps"] == from_table["steps"] == 300
    assert [(i["kind"], i["first_step"]) for i in from_log["incidents"]] == [("spike", 200)]
    assert json.dumps(from_log["findings"]) == json.dumps(from_table["findings"])


def test_an_llm_c_log_is_judged_with_its_grad_norm(tmp_path: Path) -> None:
    """llm.c's ``main.log`` (``s:N trl:... lr:... norm:...``, ``s:N tel:...`` for validation)
    was refused: no line named a step."""
    lines = []
    for step in range(0, 400):
        if step % 100 == 0:
            lines.append(f"s:{step} tel:{3.5 - step * 0.0005:.6f}")
        norm = 2.5 if step == 300 else 0.25 + 0.01 * ((step * 7) % 5 - 2)
        lines.append(f"s:{step} trl:{3.4 + 0.01 * ((step * 3) % 7 - 3):.4f} lr:0.000355 norm:{norm:.2f}")
    (tmp_path / "main.log").write_text("\n".join(lines) + "\n")
    result = report(tmp_path / "main.log")
    assert result["steps"] == 400
    assert [(i["kind"], i["first_step"]) for i in result["incidents"]] == [("spike", 300)]
