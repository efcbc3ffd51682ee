"""Carrying out an approved rollback in the trainer's own loop: restore, skip, resume.

    while True:
        if (rollback := handle_rollback(rh, load=load_checkpoint)) is not None:
            iter_num = rollback.loaded       # whatever load_checkpoint returned
        ...

An approved rollback stops every rank at the same window boundary (``rh.should_stop()``), and
``rh.directive`` names what to do: the checkpoint (path and step), the batch ids to skip, and
the devices and nodes to avoid. ``handle_rollback`` does it in order on this rank: the
trainer's own ``load`` restores the checkpoint at that path (its files in its format: model,
optimizer, scheduler, scaler, data position), and ``rh.resumed`` records what came back, so the
service checks the resume against the checkpoint, and the hook starts a new incarnation. The
skip list comes back on the result, for the trainer's data stream (``Rollback.skipping``). A
checkpoint that is one ``torch.save`` of state dicts (nanoGPT's ``ckpt.pt``) needs no load function
of its own: ``load_state_dicts(model=raw_model, optimizer=optimizer)`` is one.

Every rank calls it at the same point of its loop, between windows: the stop is agreed by the
ranks together, and ``rh.resumed`` broadcasts the new incarnation id. A window the loop left
open is closed first (the next ``window_start`` would close it too), so the stop is judged on
that window's update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from collectors.hook import RunHealth

Loaded = TypeVar("Loaded")
Batch = TypeVar("Batch")


@dataclass(frozen=True)
class Rollback(Generic[Loaded]):
    """A rollback carried out on this rank. ``loaded``: what the trainer's ``load`` returned.
    ``skip``: the batch ids the directive said to skip, as text (the service names batches by
    their ids' strings, so ``17`` and ``"17"`` are one id here)."""

    directive: int
    checkpoint_path: str
    checkpoint_step: int
    skip: frozenset[str]
    avoid_nodes: tuple[str, ...]
    avoid_devices: tuple[str, ...]
    loaded: Loaded

    def keeps(self, sample_ids: Any) -> bool:
        """Whether a batch with these ids is not to be skipped (one id, or a list of them)."""
        listed = sample_ids.tolist() if hasattr(sample_ids, "tolist") else sample_ids
        ids = listed if isinstance(listed, list | tuple) else [listed]
        return not any(_key(item) in self.skip for item in ids)

    def skipping(self, batches: Iterable[Batch], sample_ids: Callable[[Batch], Any]) -> Iterator[Batch]:
        """``batches`` without those whose ids the directive named."""
        return (batch for batch in batches if self.keeps(sample_ids(batch)))


def handle_rollback(
    rh: RunHealth,
    load: Callable[[str], Loaded],
    *,
    resume: Callable[[Loaded], Mapping[str, Any]] | None = None,
) -> Rollback[Loaded] | None:
    """Carry out the rollback ``rh`` stopped for, if it stopped for one; else None at once.

    ``load(path)``: restore the checkpoint at ``path`` into the trainer's live objects, return
    what the loop needs afterwards (its step counter, its data cursor). ``resume(loaded)``:
    more keyword arguments for ``rh.resumed`` read from that result, such as ``consumed`` or
    ``first_sample_ids``; the checkpoint's path and step come from the directive, and so does
    ``consumed`` when ``resume`` gives none (the count the checkpoint recorded, which
    ``rh.checkpoint_saved`` takes from the hook's own counter). An exception from ``load`` is
    the trainer's and passes: a rank that cannot restore must not train on."""
    rh.window_end()
    if not rh.should_stop():
        return None
    directive = rh.directive
    if directive is None or directive.get("kind") != "rollback":
        return None
    path = str(directive["checkpoint_path"])
    step = int(directive["checkpoint_step"])
    loaded = load(path)
    extra = dict(resume(loaded)) if resume is not None else {}
    if extra.get("consumed") is None and directive.get("checkpoint_consumed") is not None:
        extra["consumed"] = int(directive["checkpoint_consumed"])
    rh.resumed(checkpoint_path=path, checkpoint_step=step, **extra)
    return Rollback(
        directive=int(directive["id"]),
        checkpoint_path=path,
        checkpoint_step=step,
        skip=frozenset(_key(item) for item in directive.get("skip_batches") or ()),
        avoid_nodes=tuple(directive.get("avoid_nodes") or ()),
        avoid_devices=tuple(directive.get("avoid_devices") or ()),
        loaded=loaded,
    )


def load_state_dicts(**objects: Any) -> Callable[[str], dict[str, Any]]:
    """A ``load`` for a checkpoint that is one ``torch.save`` of a dict holding each object's
    ``state_dict()`` under its keyword (nanoGPT's ``ckpt.pt``: ``model``, ``optimizer``): each
    object's ``load_state_dict`` gets its entry, and the whole dict is returned (the step counter
    and whatever else the trainer saved). Read to the host (``map_location="cpu"``);
    ``load_state_dict`` copies each tensor to its object's device."""

    def load(path: str) -> dict[str, Any]:
        import torch

        checkpoint: dict[str, Any] = torch.load(path, map_location="cpu")
        missing = [name for name in objects if name not in checkpoint]
        if missing:
            raise KeyError(
                f"checkpoint {path} holds no {', '.join(missing)} (its keys: {sorted(checkpoint)})"
            )
        for name, target in objects.items():
            target.load_state_dict(checkpoint[name])
        return checkpoint

    return load


def _key(item: Any) -> str:
    """An id as the service names it: its string; a tensor element is read as its number."""
    return str(item.item() if hasattr(item, "item") else item)


__all__ = ["Rollback", "handle_rollback", "load_state_dicts"]
