"""Compilation as a phase of its own: heartbeats say ``compiling`` while ``torch.compile`` works.

A compiled model's first forward (and each recompilation: a new shape, eval mode) runs the
compiler on the training thread for seconds to many minutes, and the heartbeats would say
"in forward since T" all that time: past the 9 s a training phase may take once the run's
steps are known, a false hang. TorchDynamo calls its compile-start and compile-end callbacks
(``torch._dynamo.callback.callback_handler``, outermost compilation only) on the compiling
thread; between them the phase the heartbeats read is ``compiling``, which the hang rule
times as a declared save (``policies.hangs``). The window's own marks are not touched: its
forward time still includes the compilation, as it did.

Nothing here imports ``torch._dynamo`` (3 s of CPU): the callbacks are registered once it is
in ``sys.modules`` (a model compiled, or an optimizer built: torch imports it for them),
checked from the sender thread each cycle, never on the step path.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from collectors.phases import Phase, PhaseClock

log = logging.getLogger(__name__)

DYNAMO = "torch._dynamo"


class CompileWatch:
    """Sets the heartbeat phase to ``compiling`` for the length of each outermost compilation."""

    def __init__(self, phases: PhaseClock) -> None:
        self._phases = phases
        self._handler: Any = None  # torch's callback handler, once registered with it
        self._settled = False  # removed at close, or this torch has no callbacks: never again
        self._before: tuple[Phase, float, Any] | None = None
        self._lock = threading.Lock()

    @property
    def installed(self) -> bool:
        return self._handler is not None

    def install_if_loaded(self) -> None:
        """Register the callbacks once TorchDynamo is loaded (any thread; cheap when done)."""
        if self._handler is not None or self._settled or DYNAMO not in sys.modules:
            return
        with self._lock:
            if self._handler is not None or self._settled:
                return
            try:
                from torch._dynamo.callback import callback_handler
            except ImportError:  # a torch without the callbacks: compilation stays in its phase
                log.info("runhealth hook: this torch has no compile callbacks; compiling shows as its phase")
                self._settled = True
                return
            callback_handler.register_start_callback(self._started)
            callback_handler.register_end_callback(self._ended)
            self._handler = callback_handler

    def remove(self) -> None:
        """Unregister (the hook's close); never registered again after."""
        with self._lock:
            handler, self._handler, self._settled = self._handler, None, True
        if handler is not None:
            for remove, callback in (
                (handler.remove_start_callback, self._started),
                (handler.remove_end_callback, self._ended),
            ):
                try:
                    remove(callback)
                except ValueError:  # cleared by someone else (``callback_handler.clear()``)
                    pass

    # Both run inside TorchDynamo's compilation, on the training thread: a plain read and one
    # reference assignment each, nothing that can raise into the trainer's compile.

    def _started(self, _args: Any) -> None:
        before = self._phases.current
        if before[0] is Phase.COMPILING:
            return
        self._before = before
        self._phases.current = (Phase.COMPILING, time.perf_counter(), None)

    def _ended(self, _args: Any) -> None:
        before, self._before = self._before, None
        if before is not None and self._phases.current[0] is Phase.COMPILING:
            # Back in the phase the compilation interrupted, timed from now: the compile's
            # length is not that phase's.
            self._phases.current = (before[0], time.perf_counter(), before[2])
