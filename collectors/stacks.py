"""Hang evidence: every Python thread's stack and, where enabled, the NCCL flight recorder.

Called from any thread: the point is to run it while the training thread is stuck (in a
collective, say), so it only reads ``sys._current_frames()`` and asks the process group for its
trace; it takes no lock the training thread could hold.
"""

from __future__ import annotations

import json
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _from_json(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _from_pickle(raw: Any) -> str:
    # The recorder's own pickle, made by this process a moment ago: not untrusted input.
    return json.dumps(pickle.loads(raw), default=repr, indent=1)


# torch 2.13 names the recorder "fr"; earlier releases named it "nccl" (pickle only before 2.4).
FLIGHT_RECORDER_DUMPS: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("_dump_fr_trace_json", _from_json),
    ("_dump_nccl_trace_json", _from_json),
    ("_dump_nccl_trace", _from_pickle),
)


@dataclass(frozen=True)
class StackDump:
    time: float
    threads: str  # every thread's stack, as tracebacks print it
    flight_recorder: str | None  # the NCCL flight recorder's JSON, when enabled
    note: str | None = None  # why the flight recorder is missing, when it was asked for

    def text(self) -> str:
        parts = [self.threads]
        if self.flight_recorder is not None:
            parts.append(f"--- NCCL flight recorder ---\n{self.flight_recorder}")
        elif self.note:
            parts.append(f"--- NCCL flight recorder: {self.note} ---")
        return "\n".join(parts)


def thread_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        header = f'Thread {ident} "{names.get(ident, "?")}" (most recent call last):\n'
        blocks.append(header + "".join(traceback.format_stack(frame)))
    return "\n".join(blocks)


def flight_recorder(c10d: Any) -> tuple[str | None, str | None]:
    """The recorder's JSON dump, or why there is none."""
    for name, decode in FLIGHT_RECORDER_DUMPS:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            return decode(dump()), None
        except Exception as exc:  # no NCCL process group, or a build without the recorder
            return None, f"{name} failed: {exc}"
    return None, "this torch build has no flight recorder dump"


def dump_stacks(*, nccl_trace: bool = False) -> StackDump:
    """All Python thread stacks, plus the flight recorder when ``nccl_trace`` (the recorder is
    on: ``TORCH_FR_BUFFER_SIZE`` or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0)."""
    recorder, note = None, None
    if nccl_trace:
        try:
            import torch._C._distributed_c10d as c10d

            recorder, note = flight_recorder(c10d)
        except ImportError as exc:
            note = f"torch.distributed is unavailable: {exc}"
    return StackDump(time=time.time(), threads=thread_stacks(), flight_recorder=recorder, note=note)
