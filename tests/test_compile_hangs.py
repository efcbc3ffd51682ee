"""A ``torch.compile`` that itself hangs, named by the job's embedded service from the compiling
rank's CPU use (``collectors/cpu_use.py``, ``policies/hangs.py``) instead of after the
compilation's 30-minute timeout: a real trainer, its hook, heartbeats, store and hang check."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.adapters_support import run_rows
from tests.collectors_support import child_environ, embedded_store, job_running, wait_until

pytestmark = pytest.mark.slow

RUN = "compile-hang"

TRAINER = """
import sys, threading, time
import torch
from collectors import RunHealth

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

def stuck_backend(graph, inputs):
    threading.Event().wait()  # a compiler that never returns (a dead worker pool, a lost lock)

with RunHealth(model=model, optimizer=optimizer) as rh:
    for _ in range(12):  # eager steps first: the run's step times are known
        rh.window_start(examples=8)
        loss = model(torch.randn(8, 16)).pow(2).mean()
        rh.loss(loss, tokens=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rh.window_end()
        time.sleep(0.05)
    compiled = torch.compile(model, backend=stuck_backend)
    print("compiling from", time.time(), flush=True)
    rh.window_start(examples=8)
    compiled(torch.randn(8, 16))
"""


def test_a_compile_that_hangs_is_named_in_seconds_not_after_half_an_hour(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAINER)
    environ = child_environ(
        RUNHEALTH_RUN=RUN,
        RUNHEALTH_SENDER__FLUSH_INTERVAL_S="0.2",
        RUNHEALTH_HEARTBEAT_S="1",
        RUNHEALTH_SCHEDULER__HANG_CHECK_S="1",
        RUNHEALTH_POLICIES__HANGS__COMPILE_IDLE_S="5",
    )
    with job_running([sys.executable, "train.py"], tmp_path, environ) as (_job, log_path):
        db = embedded_store(tmp_path, log_path)
        started = wait_until(lambda: "compiling from" in log_path.read_text(errors="replace"), 120.0, 0.25)
        assert started, log_path.read_text(errors="replace")[-4000:]
        compiling_from = float(log_path.read_text().split("compiling from")[1].split()[0])
        hangs = lambda: [i for i in run_rows(db, "incidents", RUN) if i["kind"] == "hang"]  # noqa: E731
        assert wait_until(lambda: bool(hangs()), 90.0, 0.5), log_path.read_text(errors="replace")[-4000:]
        named_at = time.time()
    (incident,) = hangs()
    summary = incident["summary"]
    assert "rank 0 in compiling for" in summary and "its processes using no CPU for" in summary, summary
    assert "timeout 5 s" in summary
    # Named within seconds of the compile's start (5 s idle, 1 s heartbeats and checks, this
    # machine's load), where the compilation's own timeout is 30 minutes.
    assert incident["opened_at"] - compiling_from < 60.0, (incident["opened_at"], compiling_from)
    print(
        json.dumps(
            {
                "named_after_s": round(incident["opened_at"] - compiling_from, 1),
                "seen_after_s": round(named_at - compiling_from, 1),
            }
        )
    )
