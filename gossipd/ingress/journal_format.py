"""The journal's records: how one is written, and how a file of them is read back (bytes in,
records out; journal.py owns the file).

Rules:
1. A record is one MessagePack array ``[kind, body, check]``: ``kind`` a positive fixint
   (ACCEPT, DONE, FORWARDED, DEADLINE, RUNNING; a later version may add kinds, which this one
   skips),
   ``body`` a bin (the task's MessagePack, or MessagePack ``[task id, value]``) or a str (a
   task id), ``check`` a uint32 (0xce and 4 bytes, big-endian): the CRC-32 (zlib) of the
   record's bytes before it.
2. A record is read only when its check matches.  A damaged byte anywhere in it, its length
   included, fails the check: the record is lost, never the records after it (a flipped
   length was trusted, and the records it spanned were read as its body).
3. Journals written before 0.3.6 hold ``[kind, body]`` records, without a check.  They are
   read up to the first checked record (a daemon upgraded in place appends checked records
   after them), each where the one before it ended, and only where the file ends where its
   length says it ends or a record's first byte follows: whole when its body decodes as its
   kind (or its kind is unknown), or when a record begins where it ends and none that decodes
   inside it (its task is then unreadable, and counted).  After the first checked record, a record without a check is
   damage: this version writes none.
4. Damage: where a record fails (rule 2 or 3), the next one is looked for from the byte after
   the failed record's first byte: a record whose check matches, or before the first checked
   record and where the failed one does not begin as a checked record, an unchecked one of a
   known kind whose body decodes.  The bytes in between are
   damage, skipped and counted.
5. A torn tail: where no record follows a failure, the file ends in a record that a crash cut
   short; the journal cuts the file there (``Reader.torn_at``).  Text in a task that reads as
   a record by chance cannot hold the cut back (its check would have to match: 1 in 2^32).
   A CRC is no signature, though: a producer can build a record whose check matches into its
   own task (its token ids), and where damage or a torn tail falls in that task's record,
   the search may read it (docs/OPERATIONS.md, "Durability").

Theory: the check makes each record self-delimiting: its length is trusted only once its
check agrees, so damage is confined to the record it hits, and the search that follows it
(rule 4) finds the next record whatever the damaged record claimed.  A file of a daemon
upgraded in place reads as before up to where the new records begin.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import msgspec

from gossipd.core.messages import Task

ACCEPT, DONE, FORWARDED, DEADLINE, RUNNING = 1, 2, 3, 4, 5
CHECKED, UNCHECKED = 0x93, 0x92  # the array headers: [kind, body, check], [kind, body]
_UINT32 = 0xCE
_CHECK = struct.Struct(">BI")  # 0xce, the CRC-32
_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin8..32, str8..32
_STR_TAGS = (0xD9, 0xDA, 0xDB)
_encoder = msgspec.msgpack.Encoder()
_task_decoder = msgspec.msgpack.Decoder(Task)
_forwarded_decoder = msgspec.msgpack.Decoder(tuple[str, str])
_deadline_decoder = msgspec.msgpack.Decoder(tuple[str, int])  # (and RUNNING's)
# A known kind -> (whether its body is a str, how to read it).
_READ: dict[int, tuple[bool, Callable[[bytes], object] | None]] = {
    ACCEPT: (False, _task_decoder.decode),
    DONE: (True, None),
    FORWARDED: (False, _forwarded_decoder.decode),
    DEADLINE: (False, _deadline_decoder.decode),
    RUNNING: (False, _deadline_decoder.decode),
}


def append(buffer: bytearray, kind: int, body: bytes | str) -> None:
    """Write the record ``[kind, body, check]`` at the end of ``buffer``."""
    start = len(buffer)
    _encoder.encode_into((kind, body), buffer, -1)  # [kind, body]: 0x92, then they
    buffer[start] = CHECKED
    buffer += _CHECK.pack(_UINT32, zlib.crc32(memoryview(buffer)[start:]))


def record(kind: int, body: bytes | str) -> bytes:
    """One record ``[kind, body, check]``, alone."""
    buffer = bytearray()
    append(buffer, kind, body)
    return bytes(buffer)


def pair(task_id: str, value: str | int) -> bytes:
    """A FORWARDED, DEADLINE or RUNNING record's body."""
    return _encoder.encode((task_id, value))


class Record(NamedTuple):
    kind: int
    body: bytes | str
    # ``body`` read as its kind (a Task, a task id, a pair); None where it does not read as
    # one (an unreadable task) or its kind is unknown.
    value: object | None


class _Frame(NamedTuple):
    kind: int
    body_start: int
    body_end: int
    end: int
    checked: bool
    is_str: bool


class Reader:
    """``data``'s records, in order (iterate once); then where damage was skipped
    (``damaged``: (offset, bytes)) and where a torn tail begins (``torn_at``), if any."""

    def __init__(self, data: bytes | bytearray | memoryview | object) -> None:
        self._data = data  # (bytes or an mmap: sliced, searched, its len taken)
        self.damaged: list[tuple[int, int]] = []
        self.torn_at: int | None = None
        self.records = 0

    def __iter__(self) -> Iterator[Record]:
        data = self._data
        with memoryview(data) as view:  # type: ignore[arg-type]
            at, size, checked_seen = 0, len(view), False
            while at < size:
                frame = _frame(view, at, checked_only=checked_seen)
                record = None if frame is None else _read(view, frame)
                if (
                    frame is not None
                    and record is not None
                    and record.value is None
                    and not frame.checked
                    and record.kind in _READ
                ):
                    # Rule 3: a body that does not decode as its kind is whole only if a
                    # record begins where it ends and none inside it (else its length is
                    # damaged, and the records it spans are read).
                    resume = _next(data, view, at + 1, checked_only=False)
                    inside = resume is not None and resume < frame.end
                    follows = frame.end == size or _frame(view, frame.end, checked_only=False)
                    if inside or not follows:
                        record = None
                if frame is None or record is None:
                    # (a record whose header says it has a check: only such records after it)
                    checked_only = checked_seen or view[at] == CHECKED
                    resume = _next(data, view, at + 1, checked_only=checked_only)
                    if resume is None:
                        self.torn_at = at
                        return
                    self.damaged.append((at, resume - at))
                    at = resume
                    continue
                checked_seen = checked_seen or frame.checked
                self.records += 1
                at = frame.end
                yield record


def _frame(view: memoryview, at: int, *, checked_only: bool) -> _Frame | None:
    """The record whose first byte is at ``at``, as its header says, if it fits in ``view``
    and (checked) its check matches; None if not."""
    size = len(view)
    if at + 3 > size:
        return None
    head, kind, tag = view[at], view[at + 1], view[at + 2]
    if kind > 0x7F or not (head == CHECKED or (head == UNCHECKED and not checked_only)):
        return None
    pos = at + 3
    if 0xA0 <= tag <= 0xBF:  # fixstr
        length, is_str = tag & 0x1F, True
    elif tag in _LENGTH_BYTES:  # bin or str, with a length of 1, 2 or 4 bytes
        n, is_str = _LENGTH_BYTES[tag], tag in _STR_TAGS
        if pos + n > size:
            return None
        length, pos = int.from_bytes(view[pos : pos + n], "big"), pos + n
    else:
        return None
    body_end = pos + length
    checked = head == CHECKED
    end = body_end + (_CHECK.size if checked else 0)
    if end > size or (not checked and end < size and view[end] not in (CHECKED, UNCHECKED)):
        return None  # (unchecked: a record, torn or whole, begins where it ends, or none)
    if checked:
        marker, check = _CHECK.unpack_from(view, body_end)
        if marker != _UINT32 or check != zlib.crc32(view[at:body_end]):
            return None
    return _Frame(kind, pos, body_end, end, checked, is_str)


def _read(view: memoryview, frame: _Frame) -> Record | None:
    """The record ``frame`` holds; None where its body's type is not its kind's (damage)."""
    raw = view[frame.body_start : frame.body_end]
    known = _READ.get(frame.kind)
    if known is None:  # a kind from a later version: skipped by the journal
        return Record(frame.kind, bytes(raw), None)
    is_str, decode = known
    if is_str != frame.is_str:
        return None if not frame.checked else Record(frame.kind, bytes(raw), None)
    if is_str:
        try:
            text = str(raw, "utf-8")
        except UnicodeDecodeError:
            return Record(frame.kind, bytes(raw), None)
        return Record(frame.kind, text, text)
    body = bytes(raw)
    try:
        value = decode(body) if decode is not None else None
    except (msgspec.DecodeError, RecursionError):
        value = None
    return Record(frame.kind, body, value)


def _next(data: object, view: memoryview, start: int, *, checked_only: bool) -> int | None:
    """Where the first record at or after ``start`` begins (rule 4); None if there is none."""
    find = data.find  # type: ignore[attr-defined]
    at_checked = find(b"\x93", start)
    at_unchecked = -1 if checked_only else find(b"\x92", start)
    while at_checked != -1 or at_unchecked != -1:
        if at_unchecked == -1 or (at_checked != -1 and at_checked < at_unchecked):
            at, at_checked = at_checked, find(b"\x93", at_checked + 1)
        else:
            at, at_unchecked = at_unchecked, find(b"\x92", at_unchecked + 1)
        frame = _frame(view, at, checked_only=checked_only)
        if frame is None:
            continue
        if frame.checked:
            return at
        record = _read(view, frame)  # unchecked: only a known kind whose body decodes
        if record is not None and record.value is not None:
            return at
    return None
