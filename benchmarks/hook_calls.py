"""What the hook executes per step, counted rather than timed: Python and C function calls.

``hook_overhead.py`` times the hook, and on a shared machine its per-run figures move with the
machine (a run's bare step varies by 15% from one run to the next here, and the direct measure
of the hook's calls by about 10 us). A count does not: the calls the training thread makes
inside the hook's four calls per step, and the calls the sender thread makes per window it
renders, are the same on a loaded machine and a quiet one. Two trees whose counts agree run the
same code on the step path; a difference in their timings is then the machine's, or memory
placement's, not the code's.

Counted with ``sys.setprofile`` (training thread, only inside the hook's calls) and
``threading.setprofile`` (the sender thread), on a small model against the embedded service,
as ``hook_overhead.py`` runs. Printed as JSON: calls per step, calls per rendered window, and
each function's count per step.

    python benchmarks/hook_calls.py [--steps 300]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not
sys.path.insert(0, str(REPO / "benchmarks"))

import hook_overhead  # noqa: E402

from collectors import RunHealth  # noqa: E402

SENDER_THREAD = "runhealth-sender"
RENDERED = "window.py:_record"  # one call per step record the sender renders


class CallCounter:
    """Function calls by name, from a profile hook; ``active`` gates the training thread's."""

    def __init__(self, thread: str | None = None) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.active = thread is not None
        self._thread = thread

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active or event not in ("call", "c_call"):
            return
        if self._thread is not None and threading.current_thread().name != self._thread:
            return
        self.counts[_name(frame, event, arg)] += 1


def _name(frame: FrameType, event: str, arg: Any) -> str:
    if event == "c_call":
        return "C:" + str(getattr(arg, "__qualname__", arg))
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"


def counted(counter: CallCounter, call: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    counter.active = True
    sys.setprofile(counter)
    try:
        call(*args, **kwargs)
    finally:
        sys.setprofile(None)
        counter.active = False


def hooked_step(training: Any, batch: dict[str, Any], rh: RunHealth, counter: CallCounter) -> None:
    """``hook_overhead.hooked_step``'s calls, each one counted."""
    tokens = batch["tokens"]
    counted(counter, rh.window_start, sample_ids=batch["ids"])
    logits = training.model(tokens[:, :-1])
    vocab = hook_overhead.VOCAB
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    counted(counter, rh.loss, loss, labels=tokens)
    loss.backward()  # type: ignore[no-untyped-call]
    norm = torch.nn.utils.clip_grad_norm_(training.model.parameters(), 1.0)
    counted(counter, rh.grad_norm, norm)
    training.optimizer.step()
    training.optimizer.zero_grad(set_to_none=True)
    counted(counter, rh.window_end)


def run(steps: int, workdir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = hook_overhead.BenchmarkConfig(width=32, layers=1)  # counts do not depend on size
    training = hook_overhead.build_training(config)
    batches = hook_overhead.make_batches(config, 64)
    environ = {"RUNHEALTH_DB": str(workdir / "bench.db"), "RUNHEALTH_RUN": "hook-calls",
               "RUNHEALTH_SPOOL_DIR": str(workdir / "spool"), **hook_overhead._child_environ()}  # fmt: skip
    main = CallCounter()
    sender = CallCounter(SENDER_THREAD)
    threading.setprofile(sender)  # threads started from here on: the sender
    try:
        with RunHealth(model=training.model, optimizer=training.optimizer, environ=environ) as rh:
            for index in range(50):  # warm-up, not counted
                hooked_step(training, batches[index % len(batches)], rh, CallCounter())
            sender.counts.clear()
            for index in range(steps):
                hooked_step(training, batches[index % len(batches)], rh, main)
        # After the close: the sender renders what is queued every flush interval (2 s), and
        # the counted steps may all fall within one; its last flush renders the rest.
        rendered = collections.Counter(sender.counts)
    finally:
        threading.setprofile(None)
    windows = max(1, rendered[RENDERED])
    return {
        "steps": steps,
        "training_thread_calls_per_step": sum(main.counts.values()) / steps,
        "sender_calls_per_rendered_window": sum(rendered.values()) / windows,
        "sender_windows_rendered": rendered[RENDERED],
        "training_thread": {name: count / steps for name, count in main.counts.most_common()},
        "sender_per_window": {name: round(count / windows, 3) for name, count in rendered.most_common(40)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="runhealth-calls-") as workdir:
        result = run(args.steps, Path(workdir))
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
