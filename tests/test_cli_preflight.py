"""``runhealth preflight``: the memory plan and this node's canaries, one line per failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch

from collectors.canary import CanaryConfig, describe_stack, run_suite, stack_key
from monitor.config import ServiceConfig
from monitor.service import Service
from monitor.store import migrate, models
from monitor.store.db import create_store_engine, resolve_url
from tests.support import ADMIN_TOKEN, cli_result, make_run, post
from tests.test_judge_saves import saved, windows


def test_the_reference_texts_memory_example_is_rejected_with_its_arithmetic(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = cli_result(
        capsys, "preflight", "--params", "70B", "--bits", "4", "--budget-gib", "24", "--no-canaries"
    )
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        "preflight: FAIL memory: memory plan does not fit: base weights 70B x 4 bits / 8 = 35e9 bytes = "
        "32.6 GiB; total 32.6 GiB exceeds the 24 GiB usable budget by 8.6 GiB (use a smaller model, "
        "fewer bits, sharding or offloading)"
    ]


def test_a_plan_that_fits_passes_and_json_lists_its_terms(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--params", "7B", "--bits", "4", "--budget-gib", "24", "--trainable-params", "40M"]
    args += ["--gradient-bits", "16", "--optimizer-bytes", "12", "--activations-gib", "6", "--no-canaries"]
    code, out, err = cli_result(capsys, "preflight", *args, "--json")
    assert code == 0 and err == ""
    document = json.loads(out)
    assert document["ok"] and document["exit_status"] == 0
    (memory,) = document["checks"]
    assert [t["name"] for t in memory["terms"]] == [
        "base weights",
        "gradients",
        "optimizer state",
        "activations",
    ]
    assert memory["total_bytes"] == pytest.approx(3.5e9 + 8e7 + 4.8e8 + 6 * 2**30)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--params", "70X", "--budget-gib", "24"], "not a parameter count: '70X'"),
        (["--params", "70B"], "--params needs --budget-gib"),
        (["--params", "70B", "--budget-gib", "24", "--shards", "0"], "MemoryPlan.shards must be >= 1"),
        (["--no-canaries"], "nothing to check"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    code, out, err = cli_result(capsys, "preflight", *args)
    assert code == 2 and out == ""
    assert err.startswith("runhealth: error: ") and says in err and len(err.strip().splitlines()) == 1


def _store_with_golden(path: Path, corrupt: str | None) -> str:
    """A store whose golden for this CPU's stack is the suite's own output (one kernel's
    fingerprint replaced when ``corrupt`` names it)."""
    url = str(path)
    engine = create_store_engine(resolve_url(url, {}), create_dir=True)
    migrate.upgrade(engine)
    device = torch.device("cpu")
    key, suite = stack_key(describe_stack(device)), run_suite(device, CanaryConfig())
    golden = models.table_of(models.CanaryGolden)
    with engine.begin() as connection:
        for kernel, output in suite.kernels.items():
            connection.execute(
                sa.insert(golden).values(
                    stack_key=key,
                    kernel=kernel,
                    fingerprint="f" * 64 if kernel == corrupt else output.fingerprint,
                    summary=list(output.summary),
                    deterministic=True,
                    established_at=0.0,
                    established_step=0,
                    run_id=None,
                )
            )
    engine.dispose()
    return url


def test_this_nodes_canaries_match_the_golden_the_store_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _store_with_golden(tmp_path / "store.db", corrupt=None)
    code, out, err = cli_result(capsys, "preflight", "--db", url)
    assert code == 0, err
    assert (
        "preflight: ok canary: cpu: canary suite matches the golden of stack" in out and "on 5 kernels" in out
    )


def test_a_kernel_that_misses_the_golden_fails_the_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _store_with_golden(tmp_path / "store.db", corrupt="gemm_bf16")
    code, out, err = cli_result(capsys, "preflight", "--db", url, "--params", "1B", "--budget-gib", "24")
    assert code == 1
    assert "preflight: ok memory" in out
    assert err.strip().splitlines() == [
        f"preflight: FAIL canary: cpu: canary kernels gemm_bf16 miss the golden fingerprints of stack "
        f"{stack_key(describe_stack(torch.device('cpu')))}"
    ]


def _run_with_a_timed_save(tmp_path: Path, save_s: float) -> str:
    """A store whose run has 20 windows of 10 s and one save timed at ``save_s``."""

    path = tmp_path / "store.db"
    engine = create_store_engine(resolve_url(str(path), {}), create_dir=True)
    migrate.upgrade(engine)
    run = make_run(engine, "run-a")
    post(
        Service(engine, ServiceConfig(admin_token=ADMIN_TOKEN)),
        run,
        [*windows(range(20)), saved(tmp_path, 19, save_s=save_s)],
    )
    engine.dispose()
    return str(path)


@pytest.mark.parametrize(("warning", "ok"), [("30", True), ("29.9", False)])
def test_the_preemption_budget_from_the_last_runs_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], warning: str, ok: bool
) -> None:
    db = _run_with_a_timed_save(tmp_path, save_s=15.0)  # 10 + 15 + 5 = 30 s
    code, out, err = cli_result(
        capsys, "preflight", "--db", db, "--run", "run-a", "--warning-s", warning, "--no-canaries"
    )
    if ok:
        assert code == 0 and "T_warning 30 s >= T_window 10 s + T_save 15 s + T_margin 5 s = 30 s" in out
    else:
        assert code == 1 and out == ""
        assert err.strip().splitlines() == [
            "preflight: FAIL preemption_budget: run run-a's save path does not fit the warning: T_warning 29.9 s "
            "< T_window 10 s + T_save 15 s + T_margin 5 s = 30 s (slack -0.1 s; p99 of 20 windows, longest of 1 timed saves)"
        ]


def test_a_run_without_a_timed_save_cannot_pass_the_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = _run_with_a_timed_save(tmp_path, save_s=15.0)
    code, _, err = cli_result(capsys, "preflight", "--db", db, "--run", "run-a", "--no-canaries")
    assert code == 2 and "--run needs the platform's warning" in err
    engine = create_store_engine(resolve_url(db, {}))
    make_run(engine, "run-b")
    engine.dispose()
    code, _, err = cli_result(
        capsys, "preflight", "--db", db, "--run", "run-b", "--warning-s", "30", "--no-canaries"
    )
    assert code == 1 and "run run-b has no timed window and measured save" in err
