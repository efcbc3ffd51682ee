"""Windows without an update merged into the next: a loop attached with a window per microbatch.

A window is one optimizer-step attempt (the domain's "attempted accumulation window"). A loop that
accumulates gradients over K microbatches but opens a window around each one (the way a hurried
reading of the recipe attaches a Hugging Face ``no_trainer`` loop) would otherwise close K-1
windows a step without an update: each recorded as a skipped update, three in twenty of which
are a ``skip_storm`` incident, and every loss judged per microbatch.

Such a window is held open instead, and the next window's microbatches join it, when the host
already knows (no sync) that it was accumulating rather than skipping:

- no optimizer step ran in it (a GradScaler's or fused kernel's skip runs one, or steps the
  scaler), no update was observed, and no gradient norm was given (trainers clip, and guard an
  update on its norm, only where they mean to update);
- a GradScaler, when watched, neither stepped nor updated in it (``update()`` replaces its
  per-optimizer state);
- its backward left a gradient, and that gradient tensor is still the one the parameter holds
  when the next window starts. Autograd accumulates into an existing gradient in place; a
  ``zero_grad()`` (which sets gradients to None by default) or a new backward after one leaves
  another tensor. A loop that skips an update on its own and zeroes its gradients before the
  next window opens is therefore still recorded as a skip.

What is not recognised (gradients that a sharding wrapper replaces between microbatches, say)
is recorded as before: each window a skipped update, and the hook's note saying how to attach.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# At most this many windows merge into one: a loop that never updates still gets a record every
# so often. Past about 40 parts a window's phase marks overflow and its timings are left out.
MAX_PARTS = 128


def held_gradient(optimizers: Sequence[Any]) -> tuple[Any, Any] | None:
    """A parameter of the first watched optimizer and the gradient tensor it holds now; None
    when none holds one (no backward ran since the gradients were last zeroed)."""
    for group in optimizers[0].param_groups:
        for parameter in group["params"]:
            grad = parameter.grad
            if grad is not None:
                return parameter, grad
    return None


def still_accumulating(held: tuple[Any, Any]) -> bool:
    """The parameter holds the same gradient tensor as when the window was held: nothing zeroed
    it (host references only, no sync)."""
    parameter, grad = held
    return parameter.grad is grad


def merged_examples(first: int | None, more: int | None) -> int | None:
    """A merged window's example count as given: the sum when both parts gave one, else unknown
    (the window's ids or label rows count it then)."""
    return None if first is None or more is None else first + more
