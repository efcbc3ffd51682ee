"""Directives on the hook's side (``collectors/directives.py``): what a poll arms and when it
answers ``missed`` (``Armory``), and the agreement's close in a real two-process gloo group,
where a peer that never reaches the boundary does not hold this process at its exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from collectors.directives import Armory, Directive, DirectiveConfig
from tests.collectors_support import child_environ
from tests.support import free_port, require_module

RANK = """
import logging, os, sys, time
import torch, torch.distributed as dist
from collectors.directives import Consensus
logging.basicConfig(level=logging.WARNING)
rank, port, peer_joins = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "joins"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
consensus = Consensus.create(torch)
if rank == 0 or peer_joins:
    consensus.exchange(0)  # the boundary's agreement, launched
if rank == 0:
    started = time.monotonic()
    consensus.close(1.0)
    print(f"closed in {time.monotonic() - started:.2f} s", flush=True)
else:
    if peer_joins:
        consensus.close(1.0)
    time.sleep(0 if peer_joins else 120)  # hung before the boundary: never joins
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["joins", "hangs"])
def test_close_waits_for_the_agreement_at_most_its_bound(tmp_path: Path, peer: str) -> None:
    require_module("torch")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(free_port())
    environ = child_environ(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, peer],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    out, err = ranks[0].communicate(timeout=60)
    peer_still_hung = ranks[1].poll() is None
    if peer == "hangs":
        ranks[1].kill()  # its hang has shown what it had to: rank 0 closed without it
    ranks[1].communicate(timeout=60)
    assert ranks[0].returncode == 0, err
    closed_s = float(out.split("closed in ")[1].split(" s")[0])
    if peer == "joins":
        assert closed_s < 0.5 and "never joined" not in err
    else:
        assert 0.9 <= closed_s < 3.0 and "never joined the last directive agreement" in err
        assert peer_still_hung  # it did not wait for the hung peer's exit either


def test_the_close_wait_is_validated() -> None:
    with pytest.raises(ValueError, match="close_wait_s"):
        DirectiveConfig(close_wait_s=0)


def rollback(directive_id: int, step: int) -> Directive:
    return Directive(directive_id, "rollback", step, {})


def test_a_directive_armed_in_time_is_not_missed_by_a_poll_after_its_step() -> None:
    """The agreement acts one boundary late: between the directive's step and that boundary,
    the sender polls again. Answering ``missed`` then, while acting on it with the other
    ranks, made the service replace a rollback that was carried out (seen in the demo)."""
    armory, answers = Armory(), []
    armory.update([rollback(13, 449)], 440, lambda d, status, step: answers.append((d.id, status, step)))
    armory.update([rollback(13, 449)], 450, lambda d, status, step: answers.append((d.id, status, step)))
    assert answers == [] and armory.oldest_armed() == 13 and armory.known(13) is not None


def test_a_directive_first_seen_after_its_step_is_missed_and_not_armed() -> None:
    armory, answers = Armory(), []
    armory.update([rollback(14, 449)], 450, lambda d, status, step: answers.append((d.id, status, step)))
    assert answers == [(14, "missed", 450)] and armory.oldest_armed() == 0
    armory.update([rollback(14, 449)], 451, lambda d, status, step: answers.append((d.id, status, step)))
    assert answers == [(14, "missed", 450)]  # answered once


def test_a_withdrawn_directive_is_disarmed() -> None:
    armory = Armory()
    armory.update([rollback(15, 500)], 400, lambda *_: None)
    armory.update([], 401, lambda *_: None)
    assert armory.oldest_armed() == 0


def test_an_agreed_directive_is_taken_once_at_or_after_its_step() -> None:
    """Every rank contributed the directive to the agreement launched at the boundary that
    acted on it, so the next agreement names it again: it is not acted on a second time
    (``tests/test_collectors_multirank.py`` shows it on four gloo ranks)."""
    armory = Armory()
    armory.update([Directive(16, "canary", 40, {})], 30, lambda *_: None)
    assert armory.take_agreed(16, 39) is None  # agreed early: acted on once its step is reached
    assert armory.oldest_armed() == 16
    taken = armory.take_agreed(16, 40)
    assert taken is not None and taken.kind == "canary" and armory.oldest_armed() == 0
    assert armory.take_agreed(16, 44) is None
    armory.update([Directive(16, "canary", 40, {})], 45, lambda *_: pytest.fail("answered again"))
    assert armory.take_agreed(16, 48) is None and armory.take_agreed(99, 48) is None
