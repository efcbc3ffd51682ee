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

from policies.protocol import to_wire

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


class NotRendered(Exception):
    """A draft's render that knows it has no record: the failure was counted where it
    happened (the window's own entry point), and the message says what it was."""


class Draft:
    """A record still to be rendered: the sender calls ``render`` when it takes it from its queue,
    so the work happens on the sender thread, not the training thread."""

    __slots__ = ()

    def render(self) -> Record:
        raise NotImplementedError

    def identify(self) -> Record:
        """What names the record when it cannot be rendered: its kind and key, as far as
        known. The sender dead-letters it with the reason (nothing is lost unrecorded)."""
        return {"kind": type(self).__name__}


def encode_batch(records: Sequence[Record]) -> bytes:
    """The ingest body, from records already made wire-safe. Raises ``TypeError`` for a value
    JSON cannot carry to the service (an integer past 64 bits, text with a lone surrogate):
    ``encoding_problems`` names the records."""
    return _dumps({"records": list(records)})


def encoding_problems(records: Sequence[Record]) -> dict[int, str]:
    """The records of a batch that cannot be encoded, by index, each with the first field that
    cannot (called only once ``encode_batch`` failed)."""
    problems = {}
    for index, record in enumerate(records):
        try:
            _dumps(record)
        except TypeError as exc:
            problems[index] = _first_bad_field(record) or str(exc)
    return problems


def _first_bad_field(record: Record) -> str | None:
    for name, value in record.items():
        try:
            _dumps([value])
        except TypeError as exc:
            return f"field {name!r}: {exc}"
    return None


def encode_line(document: Mapping[str, Any]) -> bytes:
    """One JSON-lines entry (spool and dead-letter files), newline included. What the fast
    encoder refuses (an integer past 64 bits, a lone surrogate, an object JSON has no type for)
    is written by the standard library instead, surrogates escaped and unknown objects as their
    ``repr``: a record that cannot be sent must still be kept, with the reason it was not."""
    try:
        return _dumps(dict(document)) + b"\n"
    except TypeError:
        return json.dumps(to_wire(dict(document)), default=repr, separators=(",", ":")).encode() + b"\n"


def decode_line(line: bytes) -> Any:
    return json.loads(line)
