"""TensorBoard event files (``events.out.tfevents.*``) read as rows of scalars, without
TensorFlow, TensorBoard or protobuf: the few wire-format fields a scalar needs, decoded here.

What writes them: PyTorch's ``SummaryWriter`` (Lightning's default logger, Hugging Face's
Trainer, fairseq, and loops of their own) writes a scalar as ``Summary.Value.simple_value``;
TensorFlow 2 (Keras' ``TensorBoard`` callback, ``tf.summary.scalar``) as a rank-0 ``tensor``,
whose ``metadata`` names the ``scalars`` plugin on the tag's first value only.

The file is a TFRecord stream: each record is its data's length (8 bytes, little-endian), the
masked CRC-32C of those 8 bytes, the data (one serialized ``Event``), and the data's masked
CRC-32C. A record whose length's checksum fails is a corrupt file (an error naming the byte);
the file may end inside a record, as a live writer's file does between its flushes, and then
is read up to the last whole record, with a note. The data's checksum is checked for the
records a value is read from (a scalar's record is under a hundred bytes; checking the
megabytes of a graph or an image in pure Python would cost seconds and read nothing).

A row is one event: ``step`` and each of its scalars under its tag (``train/loss``); the
readers above map tags to fields as they map a CSV's columns. Fields used
(tensorflow/core/util/event.proto, framework/summary.proto, tensor.proto):
``Event{wall_time=1 double, step=2 int64, summary=5}``, ``Summary{value=1 repeated}``,
``Value{tag=1, simple_value=2 float, tensor=8, metadata=9}``,
``SummaryMetadata{plugin_data=1{plugin_name=1}}``, ``TensorProto{dtype=1, tensor_shape=2,
tensor_content=4, float_val=5, double_val=6, int_val=7, int64_val=10, half_val=13}``.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HEADER_BYTES = 12
"""A record's length (8 bytes) and its masked CRC-32C (4)."""
CRC_BYTES = 4
SCALARS_PLUGIN = "scalars"

# TensorProto dtype -> struct format of one element in tensor_content (types.proto DataType).
DT_FLOAT, DT_DOUBLE, DT_INT32, DT_INT64, DT_HALF = 1, 2, 3, 9, 19
CONTENT_FORMATS = {DT_FLOAT: "<f", DT_DOUBLE: "<d", DT_INT32: "<i", DT_INT64: "<q", DT_HALF: "<e"}


class EventFileError(ValueError):
    """A corrupt event file: one line naming the byte where it went wrong."""


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


CRC32C_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli), rotated right by 15 and offset, as
    tensorflow/core/lib/hash/crc32c.h ``Mask`` does."""
    crc = 0xFFFFFFFF
    table = CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@dataclass
class RecordEnd:
    """How the stream of records ended: ``None`` at a clean end, else the byte offset where a
    record was cut short (a writer still writing, or zeros a crashed writer left)."""

    cut_at: int | None = None
    reason: str = ""


def records(path: Path, end: RecordEnd | None = None) -> Iterator[tuple[int, bytes, bytes]]:
    """Each whole record of the file as (its byte offset, its data, its data's stored masked
    CRC), one at a time; where the file ends inside a record, ``end`` says so."""
    end = end if end is not None else RecordEnd()
    with path.open("rb") as raw:
        offset = 0
        while header := raw.read(HEADER_BYTES):
            if len(header) < HEADER_BYTES:
                end.cut_at, end.reason = offset, "the file ends inside a record's header"
                return
            if header == bytes(HEADER_BYTES):
                end.cut_at, end.reason = offset, "zeros from there on (a writer that stopped)"
                return
            (length,) = struct.unpack_from("<Q", header)
            (length_crc,) = struct.unpack_from("<I", header, 8)
            if masked_crc32c(header[:8]) != length_crc:
                raise EventFileError(
                    f"the record at byte {offset} has a bad length checksum: a corrupt event file"
                )
            data = raw.read(length)
            stored = raw.read(CRC_BYTES)
            if len(data) < length or len(stored) < CRC_BYTES:
                end.cut_at, end.reason = offset, "the file ends inside a record"
                return
            yield offset, data, stored
            offset += HEADER_BYTES + length + CRC_BYTES


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(data) or shift > 63:
            raise EventFileError("a varint runs past its message")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """A protobuf message's fields as (number, wire type, value): an int for varints and
    fixed-width fields (their raw little-endian bits), bytes for length-delimited ones."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, wire, value
        elif wire == 1 or wire == 5:
            width = 8 if wire == 1 else 4
            if at + width > len(data):
                raise EventFileError("a fixed-width field runs past its message")
            yield number, wire, int.from_bytes(data[at : at + width], "little")
            at += width
        elif wire == 2:
            length, at = _varint(data, at)
            if at + length > len(data):
                raise EventFileError("a field runs past its message")
            yield number, wire, data[at : at + length]
            at += length
        else:  # groups (3, 4) are not in these messages; anything else is not protobuf
            raise EventFileError(f"wire type {wire} in an event")


@dataclass
class Scalar:
    tag: str
    value: float | None
    plugin: str | None


def _float32(bits: int) -> float:
    return float(struct.unpack("<f", bits.to_bytes(4, "little"))[0])


def _float64(bits: int) -> float:
    return float(struct.unpack("<d", bits.to_bytes(8, "little"))[0])


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _repeated(wire: int, value: int | bytes, kind: str) -> list[float]:
    """A repeated numeric field, packed (one length-delimited run) or one element."""
    if isinstance(value, bytes):  # packed
        if kind == "f":
            return [float(v) for v in struct.unpack(f"<{len(value) // 4}f", value[: len(value) // 4 * 4])]
        if kind == "d":
            return [float(v) for v in struct.unpack(f"<{len(value) // 8}d", value[: len(value) // 8 * 8])]
        numbers, at = [], 0
        while at < len(value):
            number, at = _varint(value, at)
            numbers.append(number)
        return [float(_decode_int(number, kind)) for number in numbers]
    if kind == "f":
        return [_float32(value)]
    if kind == "d":
        return [_float64(value)]
    return [float(_decode_int(value, kind))]


def _decode_int(number: int, kind: str) -> int | float:
    if kind == "e":  # half_val holds a float16's bits in an int32
        return float(struct.unpack("<e", (number & 0xFFFF).to_bytes(2, "little"))[0])
    signed = _signed(number)
    return signed - (1 << 32) if kind == "i" and signed >= 1 << 31 else signed


TYPED_FIELDS = {5: "f", 6: "d", 7: "i", 10: "q", 13: "e"}
"""TensorProto's typed repeated fields: float_val, double_val, int_val, int64_val, half_val."""


def tensor_scalar(data: bytes) -> float | None:
    """A TensorProto's one number when it holds one number of a numeric dtype (rank 0, or
    every dimension 1); ``None`` for text, histograms and any other tensor."""
    dtype, elements, content = 0, 1, None
    values: list[float] = []
    for number, wire, value in fields(data):
        if number == 1 and wire == 0:
            dtype = int(value)
        elif number == 2 and isinstance(value, bytes):
            for dim_number, _, dim in fields(value):
                if dim_number == 2 and isinstance(dim, bytes):
                    size = next((int(v) for n, w, v in fields(dim) if n == 1 and w == 0), 0)
                    elements *= _signed(size)
        elif number == 4 and isinstance(value, bytes):
            content = value
        elif number in TYPED_FIELDS:
            values += _repeated(wire, value, TYPED_FIELDS[number])
    if dtype not in CONTENT_FORMATS or elements != 1:
        return None
    if content is not None:
        form = CONTENT_FORMATS[dtype]
        return float(struct.unpack(form, content)[0]) if len(content) == struct.calcsize(form) else None
    return values[0] if len(values) == 1 else None


def _plugin(metadata: bytes) -> str | None:
    for number, _, value in fields(metadata):
        if number == 1 and isinstance(value, bytes):
            for inner, _, name in fields(value):
                if inner == 1 and isinstance(name, bytes):
                    return name.decode("utf-8", "replace")
    return None


def summary_values(summary: bytes) -> Iterator[Scalar]:
    """Each value of a Summary with its tag, its number if it is a scalar, and the plugin its
    metadata names."""
    for number, _, value in fields(summary):
        if number != 1 or not isinstance(value, bytes):
            continue
        tag, scalar, plugin = "", None, None
        for inner, wire, item in fields(value):
            if inner == 1 and isinstance(item, bytes):
                tag = item.decode("utf-8", "replace")
            elif inner == 2 and wire == 5 and isinstance(item, int):
                scalar = _float32(item)
            elif inner == 8 and isinstance(item, bytes):
                scalar = tensor_scalar(item)
            elif inner == 9 and isinstance(item, bytes):
                plugin = _plugin(item)
        yield Scalar(tag, scalar, plugin)


@dataclass
class EventScalars:
    """The scalars of a file's events, in order, with the tags some plugin other than scalars
    claimed (TensorFlow names a tag's plugin on its first value only)."""

    other_plugins: set[str] = field(default_factory=set)

    def event(self, data: bytes) -> tuple[int, dict[str, float]] | None:
        """An event's step and its scalars by tag; ``None`` when it has none."""
        simple = simple_scalar_event(data)
        if simple is not None:
            at_step, tag, scalar = simple
            return (at_step, {tag: scalar}) if tag and tag not in self.other_plugins else None
        step, summary = 0, None
        for number, wire, value in fields(data):
            if number == 2 and wire == 0 and isinstance(value, int):
                step = _signed(value)
            elif number == 5 and isinstance(value, bytes):
                summary = value
        if summary is None:
            return None
        scalars = {}
        for found in summary_values(summary):
            if found.plugin is not None and found.plugin != SCALARS_PLUGIN:
                self.other_plugins.add(found.tag)
            if found.value is not None and found.tag and found.tag not in self.other_plugins:
                scalars[found.tag] = found.value
        return (step, scalars) if scalars else None


def simple_scalar_event(data: bytes) -> tuple[int, str, float] | None:
    """An event in the one layout torch's ``SummaryWriter.add_scalar`` writes (wall_time, step,
    and a Summary of one Value: a tag and a simple_value, nothing else) as its step, tag and
    value, decoded in place: most of a PyTorch file's events, at a third of the cost of reading
    them field by field. ``None`` for any other layout (step 0, which protobuf leaves out, too)."""
    if len(data) < 16 or data[0] != 0x09 or data[9] != 0x10:
        return None
    step, at = _varint(data, 10)
    if at >= len(data) or data[at] != 0x2A:
        return None
    length, at = _varint(data, at + 1)
    if at + length != len(data) or at >= len(data) or data[at] != 0x0A:
        return None
    length, at = _varint(data, at + 1)
    if at + length != len(data) or at >= len(data) or data[at] != 0x0A:
        return None
    length, at = _varint(data, at + 1)
    value_at = at + length
    if value_at + 5 != len(data) or data[value_at] != 0x15:
        return None
    (value,) = struct.unpack_from("<f", data, value_at + 1)
    return _signed(step), data[at:value_at].decode("utf-8", "replace"), float(value)


def event_scalars(
    path: Path, end: RecordEnd | None = None, checked: bool = True
) -> Iterator[tuple[int, dict[str, float]]]:
    """Each event of the file that holds a scalar, as its step and its scalars by tag, in file
    order; a corrupt record is an ``EventFileError`` naming its byte. ``checked=False`` skips
    the data's checksum (a first pass for the tags, before a checked one)."""
    scalars = EventScalars()
    for offset, data, stored in records(path, end):
        try:
            found = scalars.event(data)
        except EventFileError as exc:
            raise EventFileError(f"the record at byte {offset} is not an event ({exc})") from exc
        if found is None:
            continue
        if checked and masked_crc32c(data) != int.from_bytes(stored, "little"):
            raise EventFileError(f"the record at byte {offset} has a bad data checksum: a corrupt event file")
        yield found


EVENT_FILE_MARK = "tfevents"
"""In every event file's name: ``events.out.tfevents.<unix time>.<host>[.<pid>.<n>][.v2]``."""
EVALUATION_DIRECTORY = re.compile(
    r"^(?:val|valid|validation|eval|evaluation|test)(?:[^a-z]|$)", re.IGNORECASE
)
"""A run directory of evaluations: Keras writes ``train/`` and ``validation/``, fairseq
``train_inner/``, ``train/`` and ``valid/``."""


NOT_EVENT_SUFFIXES = (".csv", ".tsv", ".txt", ".json", ".jsonl", ".ndjson", ".log", ".out", ".md")
"""A name with the mark and one of these endings is text about event files (an export)."""


def is_event_file(path: Path) -> bool:
    return EVENT_FILE_MARK in path.name and path.suffix.lower() not in NOT_EVENT_SUFFIXES


def _written_order(path: Path) -> tuple[int, str]:
    """A run's files by the time in their names (a resumed run writes a second file), then name."""
    parts = path.name.split(".")
    stamp = parts[3] if len(parts) > 3 and parts[3].isdigit() else ""
    return (int(stamp) if stamp else 0, path.name)


@dataclass(frozen=True)
class EventRuns:
    """The event files under a path, by run (a directory that holds event files is a run,
    named by its path under the one given), and the runs left out: evaluations, and fairseq's
    epoch averages."""

    files: dict[str, list[Path]]
    left_out: tuple[str, ...]


def event_runs(path: Path) -> EventRuns:
    """A file is one run; a directory's runs are the directories under it that hold event files."""
    if not path.is_dir():
        return EventRuns({path.name: [path]}, ())
    runs: dict[str, list[Path]] = {}
    for found in sorted(path.rglob(f"*{EVENT_FILE_MARK}*")):
        if found.is_file() and is_event_file(found):
            runs.setdefault(found.parent.relative_to(path).as_posix(), []).append(found)
    left_out = tuple(name for name in runs if _evaluations(name) or _epoch_averages(name, runs))
    kept = {name: sorted(files, key=_written_order) for name, files in runs.items() if name not in left_out}
    return EventRuns(kept, left_out)


def _evaluations(run: str) -> bool:
    return any(EVALUATION_DIRECTORY.match(part) for part in run.split("/"))


def _epoch_averages(run: str, runs: dict[str, list[Path]]) -> bool:
    """fairseq's ``train/``: each epoch's averages, beside ``train_inner/``, its steps."""
    parent, _, name = run.rpartition("/")
    return name == "train" and f"{parent}/train_inner".lstrip("/") in runs
