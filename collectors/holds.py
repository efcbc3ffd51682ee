"""Holding: every rank paused at one window boundary until the hold is released.

A ``hold`` directive (``policies.responses``: the automatic response a user asked for while a
proposal waits for an operator) is agreed on like any directive (``directives.py``), so every
rank enters it at the same boundary, between two windows: none of the trainer's collectives is
in flight and none starts until the ranks leave together. While held, the training thread does
nothing but agree with its peers every ``hold_agree_s`` on what the sender thread armed
meanwhile (a blocking 16-byte all-reduce, ``Consensus.agree_now``); each agreement pairs with the
same agreement on every peer, so the ranks leave on the same one, at the step they held at:

- a ``release`` (the proposal was rejected, approved without a rollback, or timed out on the
  service's clock): training resumes;
- a ``rollback`` (the proposal was approved): the rank stops there, as at any rollback;
- every rank's own clock past the hold's timeout plus ``hold_grace_s`` (the service cannot be
  reached): they release themselves, together, since that too is agreed.

A canary directive agreed meanwhile runs; another hold is acknowledged as already held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from collectors.directives import Armory, Consensus, Directive, DirectiveConfig
from policies.responses import ResponseConfig

# What a rank contributes once its own clock is past the hold's bound: a value no directive id
# reaches, agreed only when every rank contributes it.
TIMED_OUT = 1 << 62

# A hold without a stated timeout (made by hand through the API) is bounded by the service's
# default one.
DEFAULT_TIMEOUT_S = ResponseConfig().hold_timeout_s

ReleasedBy = Literal["release", "rollback", "timeout"]


@dataclass(frozen=True)
class Released:
    by: ReleasedBy
    directive: Directive | None
    """The release or rollback that ended the hold (None: the ranks' own timeout)."""
    held_s: float


def hold_until_released(
    hold: Directive,
    armory: Armory,
    consensus: Consensus,
    config: DirectiveConfig,
    meanwhile: Callable[[Directive], None],
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Released:
    """Wait, agreeing with every peer, until a release, a rollback or the bound; ``meanwhile``
    acts on any other directive agreed during the hold."""
    bound = float(hold.payload.get("timeout_s") or DEFAULT_TIMEOUT_S) + config.hold_grace_s
    started = monotonic()
    while True:
        sleep(config.hold_agree_s)
        mine = armory.oldest_armed()
        if not mine and monotonic() - started >= bound:
            mine = TIMED_OUT
        agreed = consensus.agree_now(mine)
        if agreed == TIMED_OUT:
            return Released("timeout", None, monotonic() - started)
        directive = armory.known(agreed) if agreed else None
        if directive is None:
            continue
        armory.handled(directive.id)
        if directive.kind == "rollback":
            return Released("rollback", directive, monotonic() - started)
        if directive.kind == "release" and directive.payload.get("hold") in (None, hold.id):
            return Released("release", directive, monotonic() - started)
        meanwhile(directive)  # a canary, another hold, an older hold's late release
