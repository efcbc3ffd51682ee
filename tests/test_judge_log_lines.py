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
        # The Hugging Face Trainer's printed dict: no step (log_rows counts them)
        (
            "{'loss': 2.345, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.1}",
            {"loss": "2.345", "grad_norm": "1.2", "lr": "5e-05"},
        ),
        (
            "{'loss': nan, 'grad_norm': tensor(1.5, device='cuda:0'), 'learning_rate': 5e-05, 'epoch': 0.2}",
            {"loss": "nan", "grad_norm": "1.5", "lr": "5e-05"},
        ),
        ("{'eval_loss': 2.1, 'eval_runtime': 4.12, 'epoch': 1.0}", None),
        (  # a step named before the dict is its step
            "Step 100: {'loss': 2.345, 'learning_rate': 5e-05, 'epoch': 0.1}",
            {"step": "100", "loss": "2.345", "lr": "5e-05"},
        ),
        ("{'train_runtime': 439.1, 'train_loss': 2.63, 'epoch': 1.0}", None),  # the run's mean
        ("{'loss': 2.0}", None),  # a dict of no epoch and no step: not the Trainer's
        # ms-swift's dict names its step as global_step/max_steps
        (
            "{'loss': 1.2, 'learning_rate': 1e-05, 'epoch': 0.1, 'global_step/max_steps': '5/100'}",
            {"step": "5", "loss": "1.2", "lr": "1e-05"},
        ),
        # MMEngine; InternLM/xtuner, commit 9470deb3467fdc73fee10d43a4b37ad3bc4c9111,
        # docs/en/get_started/quickstart.md
        (
            "01/29 21:36:02 - mmengine - INFO - Iter(train) [ 20/720]  lr: 1.9000e-04  eta: 0:32:01  "
            "time: 2.8037  data_time: 0.0071  memory: 13969  loss: 2.6049  grad_norm: 0.9361",
            {"step": "20", "loss": "2.6049", "grad_norm": "0.9361", "lr": "1.9000e-04"},
        ),
        # epoch-based, [epoch][iteration/iterations]: a YOLO-World fine-tuning log's line as found in
        # the public code index (its repository not identified), the epoch changed from 1 to 2
        (
            "2024/06/19 01:21:51 - mmengine - INFO - Epoch(train)  [2][  50/1509]  base_lr: 2.0000e-04 "
            "lr: 2.1648e-06  eta: 8:27:55  time: 0.2526  data_time: 0.0334  memory: 9182  grad_norm: nan  "
            "loss: 59.1782  loss_cls: 21.0711  loss_bbox: 18.8034  loss_dfl: 19.3038",
            {"step": "1559", "loss": "59.1782", "grad_norm": "nan", "lr": "2.1648e-06"},
        ),
        ("06/16 08:23:02 - mmengine - INFO - Iter(val) [17/17]    aAcc: 86.3900  mIoU: 51.1200", None),
        # DeepSpeed's pipeline engine; microsoft/onnxruntime, commit 96325203c1aa06d6e881b87ea35cad20434cb165,
        # orttraining/orttraining/test/python/orttraining_test_ortmodule_deepspeed_pipeline_parallel.py
        # ("expected output")
        (
            "steps: 100 loss: 0.0585 iter time (s): 0.186 samples/sec: 53.694",
            {"step": "100", "loss": "0.0585"},
        ),
        ("0: steps: 20 loss: nan iter time (s): 0.2 samples/sec: 50.0", {"step": "20", "loss": "nan"}),
        ("TrainingArguments(learning_rate=5e-05, warmup_steps=500, logging_steps=500)", None),
        # fairseq --log-format simple (fairseq/logging/progress_bar.py SimpleProgressBar): a step's
        # line under train_inner, the epoch's averages under train, validation under valid
        (
            "2020-01-01 00:00:00 | INFO | train_inner | epoch 001:    100 / 1000 loss=7.123, nll_loss=7.0, "
            "ppl=139.4, wps=1000, ups=1, wpb=1000, bsz=8, num_updates=100, lr=0.0005, gnorm=1.234, "
            "loss_scale=8, train_wall=10, gb_free=9.3, wall=20",
            {"step": "100", "loss": "7.123", "grad_norm": "1.234", "lr": "0.0005", "loss_scale": "8"},
        ),
        (
            "2020-01-01 00:00:00 | INFO | train | epoch 001 | loss 7.5 | nll_loss 7.4 | ppl 180 | "
            "num_updates 1000 | lr 0.0005 | gnorm 1.5 | loss_scale 8",
            None,
        ),
        (
            "2020-01-01 00:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 6.9 | "
            "num_updates 1000",
            None,
        ),
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
    was refused: no line named a step. The grad norm is 10x for two steps (one step alone, the
    loss unmoved, is noted and no incident: ``policies.confirm``)."""
    lines = []
    for step in range(0, 400):
        if step % 100 == 0:
            lines.append(f"s:{step} tel:{3.5 - step * 0.0005:.6f}")
        norm = 2.5 if step in (300, 301) else 0.25 + 0.01 * ((step * 7) % 5 - 2)
        lines.append(f"s:{step} trl:{3.4 + 0.01 * ((step * 3) % 7 - 3):.4f} lr:0.000355 norm:{norm:.2f}")
    (tmp_path / "main.log").write_text("\n".join(lines) + "\n")
    result = report(tmp_path / "main.log")
    assert result["steps"] == 400
    assert [(i["kind"], i["first_step"]) for i in result["incidents"]] == [("spike", 300)]
    assert {(f["kind"], f["step"]) for f in result["findings"]} == {
        ("grad_norm_spike", 300),
        ("grad_norm_spike", 301),
    }


# aws-solutions-library-samples/guidance-for-protein-language-esm-model-training-with-sagemaker-hyperpod,
# commit 488697e4f07fe516122c8d6126e9a04b0518bd90, esm2_models/slurm/README.md: a Hugging Face
# Trainer's FSDP run on 2 nodes under `srun --label` (its `esm2-fsdp-esm2-fsdp.20.out`), and the
# DDP run's evaluation lines from the same file. Copied as published.
HF_TRAINER_OUT = """\
1: [INFO|trainer.py:2134] 2025-05-02 22:42:34,741 >>   Total train batch size (w. parallel, distributed & accumulation) = 88
1: [INFO|trainer.py:2135] 2025-05-02 22:42:34,741 >>   Gradient Accumulation steps = 11
1: [INFO|trainer.py:2136] 2025-05-02 22:42:34,741 >>   Total optimization steps = 1,136
1: [INFO|trainer.py:2137] 2025-05-02 22:42:34,742 >>   Number of trainable parameters = 3,920,390
1: ip-10-1-40-172:48007:48141 [0] NCCL INFO Connected binomial trees
0: ip-10-1-39-225:48124:48261 [0] NCCL INFO Connected binomial trees
0: {'loss': 3.0288, 'grad_norm': 1.4424070119857788, 'learning_rate': 4.929577464788733e-05, 'epoch': 0.01}
  2%|▏         | 18/1136 [00:08<08:31,  2.19it/s]
0: {'loss': 2.8485, 'grad_norm': 3.385751724243164, 'learning_rate': 4.8591549295774653e-05, 'epoch': 0.03}
  3%|▎         | 35/1136 [00:16<08:18,  2.21it/s]
0: {'loss': 2.7659, 'grad_norm': 1.916214942932129, 'learning_rate': 4.788732394366197e-05, 'epoch': 0.04}
  5%|▍         | 53/1136 [00:24<08:10,  2.21it/s]
0: {'loss': 2.7257, 'grad_norm': 2.18135142326355, 'learning_rate': 4.71830985915493e-05, 'epoch': 0.06}
  6%|▋         | 71/1136 [00:32<07:59,  2.22it/s]]
0: {'loss': 2.708, 'grad_norm': 2.5152652263641357, 'learning_rate': 4.647887323943662e-05, 'epoch': 0.07}
  8%|▊         | 89/1136 [00:40<07:55,  2.20it/s]
0: {'loss': 2.7009, 'grad_norm': 1.8158063888549805, 'learning_rate': 4.577464788732395e-05, 'epoch': 0.08}
  9%|▉         | 106/1136 [00:48<07:43,  2.22it/s]
0: {'loss': 2.6211, 'grad_norm': 0.8737764954566956, 'learning_rate': 1.4084507042253521e-06, 'epoch': 0.97}
 98%|█████████▊| 1117/1136 [08:21<00:08,  2.25it/s]
0: {'loss': 2.6324, 'grad_norm': 0.726458728313446, 'learning_rate': 7.042253521126761e-07, 'epoch': 0.99}
 99%|███████�█▉| 1129/1136 [08:26<00:03,  2.25it/s]
0: {'loss': 2.6166, 'grad_norm': 0.8394569158554077, 'learning_rate': 0.0, 'epoch': 1.0}
100%|██████████| 1136/1136 [08:29<00:00,  2.25it/s]/usr/local/lib/python3.12/dist-packages/torch/distributed/fsdp/fully_sharded_data_parallel.py:690: FutureWarning: FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated.
0: [INFO|trainer.py:3478] 2025-05-02 22:51:04,774 >> Saving model checkpoint to /fsx/ubuntu/esm-slurm/out-fsdp/checkpoint-1136
1: [INFO     | __main__           ]: Metrics are {'eval_loss': 2.6093177795410156, 'eval_accuracy': 0.20685649827919567, 'eval_runtime': 75.8886, 'eval_samples_per_second': 658.86, 'eval_steps_per_second': 41.179, 'epoch': 1.0}
0: [INFO     | __main__           ]: Metrics are {'eval_loss': 2.6093177795410156, 'eval_accuracy': 0.20685649827919567, 'eval_runtime': 76.5074, 'eval_samples_per_second': 653.532, 'eval_steps_per_second': 40.846, 'epoch': 1.0}
0:   eval_loss               =     2.6093
"""

# facebookresearch/fairseq, commit 652040583be7a2eecd1aaa12f8b3371e9af28ca6,
# examples/fully_sharded_data_parallel/README.md: a 13B GPT-3 on one GPU, --log-format json
# --log-interval 1 (the published "# " before each line taken off).
FAIRSEQ_JSON = """\
2021-03-08 12:29:51 | INFO | fairseq_cli.train | training on 1 devices (GPUs/TPUs)
2021-03-08 12:29:51 | INFO | fairseq_cli.train | max tokens per GPU = None and batch size per GPU = 8
Adam Optimizer #0 is created with AVX2 arithmetic capability.
Config: alpha=0.000100, betas=(0.900000, 0.980000), weight_decay=0.000000, adam_w=1
2021-03-08 12:31:36 | INFO | train_inner | {"epoch": 1, "update": 0.0, "loss": "16.475", "ppl": "91120.8", "wps": "0", "ups": "0", "wpb": "16384", "bsz": "8", "num_updates": "1", "lr": "2e-05", "gnorm": "20.751", "loss_scale": "4", "train_wall": "99", "gb_free": "9.3", "wall": "105"}
2021-03-08 12:32:33 | INFO | train_inner | {"epoch": 1, "update": 0.0, "loss": "16.446", "ppl": "89281.6", "wps": "288.7", "ups": "0.02", "wpb": "16384", "bsz": "8", "num_updates": "2", "lr": "4e-05", "gnorm": "19.777", "loss_scale": "4", "train_wall": "57", "gb_free": "9.3", "wall": "161"}
2021-03-08 12:33:12 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 2.0
2021-03-08 12:33:51 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 1.0
2021-03-08 12:34:45 | INFO | train_inner | {"epoch": 1, "update": 0.001, "loss": "25.22", "ppl": "3.90691e+07", "wps": "123.4", "ups": "0.01", "wpb": "16384", "bsz": "8", "num_updates": "3", "lr": "6e-05", "gnorm": "131.281", "loss_scale": "1", "train_wall": "133", "gb_free": "9.3", "wall": "294"}
2021-03-08 12:35:43 | INFO | train_inner | {"epoch": 1, "update": 0.001, "loss": "18.079", "ppl": "276809", "wps": "285.5", "ups": "0.02", "wpb": "16384", "bsz": "8", "num_updates": "4", "lr": "8e-05", "gnorm": "13.776", "loss_scale": "1", "train_wall": "57", "gb_free": "9.3", "wall": "351"}
2021-03-08 12:36:35 | INFO | train_inner | {"epoch": 1, "update": 0.001, "loss": "23.729", "ppl": "1.39088e+07", "wps": "316.7", "ups": "0.02", "wpb": "16384", "bsz": "8", "num_updates": "5", "lr": "0.0001", "gnorm": "72.774", "loss_scale": "1", "train_wall": "52", "gb_free": "9.3", "wall": "403"}
2021-03-08 12:37:28 | INFO | train_inner | {"epoch": 1, "update": 0.001, "loss": "20.429", "ppl": "1.41203e+06", "wps": "307.6", "ups": "0.02", "wpb": "16384", "bsz": "8", "num_updates": "6", "lr": "8e-05", "gnorm": "60.846", "loss_scale": "1", "train_wall": "53", "gb_free": "9.3", "wall": "456"}
2021-03-08 12:38:27 | INFO | train_inner | {"epoch": 1, "update": 0.001, "loss": "18.965", "ppl": "511684", "wps": "279.4", "ups": "0.02", "wpb": "16384", "bsz": "8", "num_updates": "7", "lr": "6e-05", "gnorm": "22.687", "loss_scale": "1", "train_wall": "59", "gb_free": "9.3", "wall": "515"}
2021-03-08 12:39:18 | INFO | train_inner | {"epoch": 1, "update": 0.001, "loss": "18.345", "ppl": "332887", "wps": "319.1", "ups": "0.02", "wpb": "16384", "bsz": "8", "num_updates": "8", "lr": "4e-05", "gnorm": "8.451", "loss_scale": "1", "train_wall": "51", "gb_free": "9.3", "wall": "566"}
2021-03-08 12:40:11 | INFO | train_inner | {"epoch": 1, "update": 0.002, "loss": "18.262", "ppl": "314336", "wps": "305.9", "ups": "0.02", "wpb": "16384", "bsz": "8", "num_updates": "9", "lr": "2e-05", "gnorm": "6.457", "loss_scale": "1", "train_wall": "54", "gb_free": "9.3", "wall": "620"}
2021-03-08 12:41:04 | INFO | train_inner | {"epoch": 1, "update": 0.002, "loss": "17.556", "ppl": "192686", "wps": "311.8", "ups": "0.02", "wpb": "16384", "bsz": "8", "num_updates": "10", "lr": "0", "gnorm": "5.796", "loss_scale": "1", "train_wall": "53", "gb_free": "9.3", "wall": "673"}
2021-03-08 12:41:04 | INFO | fairseq_cli.train | Stopping training due to num_updates: 10 >= max_update: 10
2021-03-08 12:41:04 | INFO | fairseq_cli.train | begin validation on "valid" subset
2021-03-08 12:43:15 | INFO | valid | {"epoch": 1, "valid_loss": "17.953", "valid_ppl": "253807", "valid_wps": "1868.4", "valid_wpb": "15400.2", "valid_bsz": "7.6", "valid_num_updates": "10"}
2021-03-08 12:43:15 | INFO | fairseq_cli.train | end of epoch 1 (average epoch stats below)
2021-03-08 12:43:15 | INFO | train | {"epoch": 1, "train_loss": "19.351", "train_ppl": "668509", "train_wps": "210.9", "train_ups": "0.01", "train_wpb": "16384", "train_bsz": "8", "train_num_updates": "10", "train_lr": "0", "train_gnorm": "36.26", "train_loss_scale": "1", "train_train_wall": "667", "train_gb_free": "9.3", "train_wall": "804"}
2021-03-08 12:43:15 | INFO | fairseq_cli.train | done training in 798.6 seconds
"""


def test_a_hugging_face_trainer_out_file_is_read_as_its_printed_dicts_in_order(tmp_path: Path) -> None:
    """Before: refused ("no line names a step and a loss, ..."): the Trainer's dicts name no step."""
    path = tmp_path / "esm2-fsdp-esm2-fsdp.20.out"
    path.write_text(HF_TRAINER_OUT)
    loaded = load_series(path, {}, None)
    [series] = loaded.series
    assert [p.step for p in series.points] == list(range(1, 10))
    assert [p.loss for p in series.points][:2] == [3.0288, 2.8485]
    assert series.points[0].grad_norm == 1.4424070119857788 and series.points[-1].lr == 0.0
    assert loaded.notes[0] == (
        "9 printed dicts name no step (the Hugging Face Trainer's): their steps are their order, "
        "1, 2, 3, ..., one per logging_steps"
    )


def test_a_fairseq_json_log_is_read_by_num_updates_without_its_validation_or_epoch_lines(
    tmp_path: Path,
) -> None:
    """Before: refused (no line named a step: fairseq counts ``num_updates``)."""
    path = tmp_path / "train.log"
    path.write_text(FAIRSEQ_JSON)
    loaded = load_series(path, {}, None)
    [series] = loaded.series
    assert [p.step for p in series.points] == list(range(1, 11))
    assert [p.loss for p in series.points][:3] == [16.475, 16.446, 25.22]
    assert [p.grad_norm for p in series.points][2] == 131.281
    assert [p.loss_scale for p in series.points][:3] == [4.0, 4.0, 1.0]
    assert loaded.notes == []  # steps named, none counted


def test_a_trainer_log_is_judged_as_the_same_series_in_a_csv_through_a_progress_bar(tmp_path: Path) -> None:
    """tqdm redraws its bar after a carriage return: a long run's log holds megabytes between two
    line breaks, which was refused ("line 1 is longer than 1 MiB: not a log")."""
    losses = [3.0 - s * 0.001 + 0.01 * ((s * 7) % 5 - 2) for s in range(1, 301)]
    losses[199] = 9.0  # the 200th logged dict
    bar = "".join(f"\r {i % 100:3d}%|#####     | {i}/30000 [00:10<01:30,  5.00it/s]" for i in range(12_000))
    with (tmp_path / "train.out").open("w") as out:
        out.write(bar)
        for step, loss in enumerate(losses, 1):
            out.write(
                f"\r{{'loss': {loss:.4f}, 'grad_norm': 1.0, 'learning_rate': 5e-05, 'epoch': {step / 300:.2f}}}\n"
            )
            if step == 100:
                out.write(bar)
                out.write("\r{'eval_loss': 2.9, 'eval_runtime': 4.12, 'epoch': 0.33}\n")
        out.write(
            "{'train_runtime': 439.1, 'train_samples_per_second': 227.7, 'train_loss': 2.63, 'epoch': 1.0}\n"
        )
    assert (tmp_path / "train.out").stat().st_size > 1 << 20
    csv = pl.DataFrame(
        {"step": range(1, 301), "loss": [round(v, 4) for v in losses], "grad_norm": [1.0] * 300}
    )
    csv.with_columns(lr=pl.lit(5e-05)).write_csv(tmp_path / "s.csv")
    from_log, from_csv = report(tmp_path / "train.out"), report(tmp_path / "s.csv")
    assert from_log["steps"] == 300
    assert [(i["kind"], i["first_step"]) for i in from_log["incidents"]] == [("spike", 200)]
    assert json.dumps(from_log["findings"]) == json.dumps(from_csv["findings"])


# InternLM/xtuner, commit 9470deb3467fdc73fee10d43a4b37ad3bc4c9111, docs/en/get_started/quickstart.md
# ("The correct training log may look similar to the one shown below"), its first four lines.
XTUNER_LOG = """\
01/29 21:35:34 - mmengine - INFO - Iter(train) [ 10/720]  lr: 9.0001e-05  eta: 0:31:46  time: 2.6851  data_time: 0.0077  memory: 12762  loss: 2.6900
01/29 21:36:02 - mmengine - INFO - Iter(train) [ 20/720]  lr: 1.9000e-04  eta: 0:32:01  time: 2.8037  data_time: 0.0071  memory: 13969  loss: 2.6049  grad_norm: 0.9361
01/29 21:36:29 - mmengine - INFO - Iter(train) [ 30/720]  lr: 1.9994e-04  eta: 0:31:24  time: 2.7031  data_time: 0.0070  memory: 13969  loss: 2.5795  grad_norm: 0.9361
01/29 21:36:57 - mmengine - INFO - Iter(train) [ 40/720]  lr: 1.9969e-04  eta: 0:30:55  time: 2.7247  data_time: 0.0069  memory: 13969  loss: 2.3352  grad_norm: 0.8482
"""


def test_an_mmengine_log_is_read_by_its_iterations(tmp_path: Path) -> None:
    """Before: refused ("no line names a step ..."): ``Iter(train) [ 10/720]`` names no step word."""
    path = tmp_path / "20240129_213458.log"
    path.write_text(XTUNER_LOG)
    [series] = load_series(path, {}, None).series
    assert [(p.step, p.loss, p.grad_norm) for p in series.points] == [
        (10, 2.69, None),
        (20, 2.6049, 0.9361),
        (30, 2.5795, 0.9361),
        (40, 2.3352, 0.8482),
    ]
