"""A data loader's or sampler's restored state as one digest, comparable across restores.

``rh.resumed(data_state=...)`` takes what the trainer restored its data position from: a
``StatefulDataLoader.state_dict()``, a sampler's state, a seed and an offset, or any object with
a ``state_dict()``. The service keeps only the sha256 (a loader's state can hold every worker's
RNG state and buffered examples: large, and nothing the service reads), and two restores of one
checkpoint must give the same one. Runs once, at resume: a tensor in the state is copied to the
host here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

# Plain values digested by their repr: stable across processes, unlike an object's default repr
# (it holds an address).
PLAIN = (str, int, float, bool, type(None))


def state_digest(state: Any) -> str:
    """sha256 over the state's content: mappings by sorted key, sequences in order, tensors and
    arrays by dtype, shape and bytes, objects with ``state_dict()`` by that state."""
    hasher = hashlib.sha256()
    _feed(hasher, state)
    return hasher.hexdigest()


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, PLAIN):
        hasher.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, bytes | bytearray | memoryview):
        hasher.update(b"bytes:%d;" % len(value))
        hasher.update(value)
    elif isinstance(value, Mapping):
        _feed_items(hasher, b"map", sorted(value.items(), key=lambda item: repr(item[0])))
    elif isinstance(value, list | tuple):
        _feed_items(hasher, b"seq", list(value))
    elif isinstance(value, set | frozenset):
        _feed_items(hasher, b"set", sorted(value, key=repr))
    elif hasattr(value, "detach") or hasattr(value, "tobytes"):
        _feed_array(hasher, value)
    elif callable(getattr(value, "state_dict", None)):
        _feed(hasher, value.state_dict())
    else:
        raise TypeError(
            f"data_state: cannot digest a {type(value).__name__}; hand over its state (a dict of "
            "numbers, strings, bytes and tensors, or an object with state_dict())"
        )


def _feed_items(hasher: Any, tag: bytes, items: list[Any]) -> None:
    hasher.update(tag + b"%d[" % len(items))
    for item in items:
        _feed(hasher, item)
    hasher.update(b"]")


def _feed_array(hasher: Any, value: Any) -> None:
    """A torch tensor (an RNG state is a ByteTensor) or a numpy array, by its bytes."""
    dtype, shape = str(value.dtype), tuple(value.shape)
    if hasattr(value, "detach"):
        tensor = value.detach().cpu().contiguous()
        if tensor.dtype.is_floating_point:
            tensor = tensor.double()  # bfloat16 has no numpy dtype; float64 holds every float exactly
        data = tensor.numpy().tobytes()
    else:
        data = value.tobytes()
    hasher.update(f"array:{dtype}:{shape}:".encode())
    hasher.update(data)
