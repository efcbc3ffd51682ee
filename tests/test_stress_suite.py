"""scripts/stress_suite.py: the load it makes is real, ended by PID, and its report reads pytest."""

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import stress_suite
finally:
    sys.path.remove(str(REPO / "scripts"))


def test_the_summary_line_is_read_with_every_kind() -> None:
    output = "....F\nFAILED tests/test_x.py::test_y - boom\n3 passed, 1 failed, 2 errors, 1 skipped in 9.1s\n"
    assert stress_suite.counts(output) == {"passed": 3, "failed": 1, "error": 2, "skipped": 1}
    assert stress_suite.counts("no tests ran in 0.01s\n") == {}


def test_the_busy_processes_use_a_core_each_and_are_ended() -> None:
    busy = stress_suite.start_busy(1)
    try:
        time.sleep(1.0)
        with open(f"/proc/{busy[0].pid}/stat") as stat:
            ticks = int(stat.read().split()[13])  # utime, in clock ticks
        assert ticks / os.sysconf("SC_CLK_TCK") > 0.2  # it ran, not slept
    finally:
        stress_suite.stop(busy)
    assert busy[0].returncode is not None
