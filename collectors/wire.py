"""Records on the wire: JSON, with nonfinite floats written as names.

The service reads ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` where a number is expected;
standard JSON has no token for them, and a NaN loss is the very signal runhealth exists to
catch, so they must survive the trip. The codec is the protocol's
(``policies.protocol.nonfinite``), shared with the service; records are built through the
protocol too (``policies.protocol.build``; step records in ``collectors.window``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Record = dict[str, Any]


def _stdlib_dumps(document: Any) -> bytes:
    # allow_nan=False: a nonfinite float that escaped ``protocol.to_wire`` fails loudly, not as NaN.
    return json.dumps(document, allow_nan=False, separators=(",", ":")).encode()


def _fast_dumps() -> Callable[[Any], bytes]:
    """orjson when installed (a dependency of the runhealth package): about ten times faster
    than ``json`` on a batch, and the sender's CPU is the trainer's CPU. orjson would write a
    stray NaN as null, so records are made wire-safe before they are encoded, always."""
    try:
        import orjson
    except ImportError:
        return _stdlib_dumps
    dumps: Callable[[Any], bytes] = orjson.dumps
    return dumps


_dumps = _fast_dumps()


class Draft:
    """A record still to be rendered: the sender calls ``render`` when it takes it from its queue,
    so the work happens on the sender thread, not the training thread."""

    __slots__ = ()

    def render(self) -> Record:
        raise NotImplementedError


def encode_batch(records: Sequence[Record]) -> bytes:
    """The ingest body, from records already made wire-safe."""
    return _dumps({"records": list(records)})


def encode_line(document: Mapping[str, Any]) -> bytes:
    """One JSON-lines entry (spool and dead-letter files), newline included."""
    return _dumps(dict(document)) + b"\n"


def decode_line(line: bytes) -> Any:
    return json.loads(line)
