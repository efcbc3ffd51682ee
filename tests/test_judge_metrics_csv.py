"""Lightning's ``CSVLogger`` ``metrics.csv`` read by ``runhealth backtest``: a value logged with
``on_step=True, on_epoch=True`` is written as ``<name>_step`` and ``<name>_epoch``, so no column
was read as the loss and the file was refused ("the file has none of the signals loss, ...")."""

from __future__ import annotations

from pathlib import Path

import pytest

from monitor.judge.backtest import BacktestError, backtest, load_series, report_json
from policies.series import SeriesConfig

# 0Xero7/slm_training, commit d4575f90030ef6839b1717d96ea4dbc355b4b7e6,
# lightning_logs/version_0/metrics.csv: the header and its first 22 rows, as published.
LIGHTNING_METRICS = """\
epoch,epoch_time,step,train_epoch_perplexity,train_loss_epoch,train_loss_step,train_perplexity_epoch,train_perplexity_step,val_epoch_perplexity,val_loss,val_perplexity
0,,49,,,8.620475769042969,,5544.0234375,,,
0,,99,,,7.601476669311523,,2001.1488037109375,,,
0,,149,,,7.221154689788818,,1368.06787109375,,,
0,,199,,,6.983570575714111,,1078.7633056640625,,,
0,,249,,,6.828794956207275,,924.0765991210938,,,
0,,286,,,,,,928.60546875,6.833683967590332,935.6399536132812
0,155.4527130126953,286,2080.531982421875,7.640378952026367,,3753.686279296875,,,,
1,,299,,,6.816020488739014,,912.3470458984375,,,
1,,349,,,6.732990741729736,,839.6547241210938,,,
1,,399,,,6.626404285430908,,754.763427734375,,,
1,,449,,,6.621363639831543,,750.968505859375,,,
1,,499,,,6.484894752502441,,655.1699829101562,,,
1,,549,,,6.578193664550781,,719.239013671875,,,
1,,573,,,,,,644.2499389648438,6.4680867195129395,649.3938598632812
1,37.71946334838867,573,745.6710205078125,6.614284515380859,,750.7208862304688,,,,
2,,599,,,6.463803291320801,,641.4962158203125,,,
2,,649,,,6.297844409942627,,543.3992919921875,,,
2,,699,,,6.394858360290527,,598.758544921875,,,
2,,749,,,6.349593162536621,,572.2598266601562,,,
2,,799,,,6.136107921600342,,462.2509460449219,,,
2,,849,,,6.244985103607178,,515.4215698242188,,,
2,,860,,,,,,522.463134765625,6.258554458618164,526.7822265625
"""


def test_a_lightning_metrics_csv_is_judged_on_its_step_loss_not_its_epoch_or_validation_loss(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text(LIGHTNING_METRICS)
    loaded = load_series(path, {}, None)
    [series] = loaded.series
    assert [p.step for p in series.points] == list(range(49, 850, 50))  # 573: validation, epoch
    assert series.points[0].loss == 8.620475769042969 and series.points[5].loss == 6.816020488739014
    assert "read column 'train_loss_step' as loss (--column train_loss_step=FIELD to choose)" in loaded.notes
    report = report_json(backtest(loaded, SeriesConfig()), loaded.notes, path)
    assert report["steps"] == 17


# The columns Keras' CSVLogger writes (`epoch`, then the logs' keys sorted), one row an epoch, with
# the values of the Keras run whose event files are in tests/data/tfevents/keras_mnist (epochs 0-2).
KERAS_CSV = """\
epoch,accuracy,loss,val_accuracy,val_loss
0,0.9131875038146973,0.29735517501831055,0.9589166641235352,0.1429041177034378
1,0.9594166874885559,0.13642872869968414,0.9692500233650208,0.1042250245809555
2,0.9701250195503235,0.09945375472307205,0.9740833044052124,0.08732964843511581
"""


def test_a_keras_csv_log_is_refused_with_the_mapping_that_reads_it_by_epoch(tmp_path: Path) -> None:
    path = tmp_path / "training.log.csv"
    path.write_text(KERAS_CSV)
    with pytest.raises(BacktestError) as raised:
        load_series(path, {}, None)
    assert str(raised.value) == (
        "the file has no 'step' column (map one with --column SRC=step); a log of one row an epoch "
        "(Keras' CSVLogger) is judged by epoch with --column epoch=step"
    )
    [series] = load_series(path, {"epoch": "step"}, None).series
    assert [p.step for p in series.points] == [0, 1, 2] and series.points[0].loss == 0.29735517501831055
