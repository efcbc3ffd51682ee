"""Supervised token counts, on the device, without a synchronization.

The convention (it matters for the token-weighted loss): a token is supervised when its label
is not the ignore index (``-100``, PyTorch's ``cross_entropy`` default and Hugging Face's
convention). With ``shift=True`` the labels are the inputs themselves and the model predicts
position ``t + 1`` from position ``t`` (Hugging Face causal LMs shift inside the model), so the
first label of each sequence is never a target and is not counted. Pass ``shift=False`` when
the labels are already the targets (``labels = tokens[:, 1:]``). One-dimensional labels are one
class per example (a classifier's ``y``), not a sequence: every one is a target, whatever
``shift`` says (shifted, a batch of 32 counted 31, and a batch of 1 none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100


def supervised_tokens(
    labels: torch.Tensor, *, shift: bool = True, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The number of supervised tokens in ``labels``, as a 0-dim tensor on their device.

    float64, not int64: the count is packed with float losses into one host copy (see
    ``ring.py``), and float64 keeps every count below 2**53 exact. No ``.item()`` here: the
    count stays on the device until the ring reads it.
    """
    import torch

    targets = labels[..., 1:] if shift and labels.dim() > 1 else labels
    return targets.ne(ignore_index).sum(dtype=torch.float64)
