"""A converged member table shared by many simulated members, copy-on-write (sans-IO).

For the simulator only: a real daemon joins through seeds and builds its own table.  At start
every simulated member knows every other alive at incarnation 0, so N members would hold N
identical tables (N^2 entries: 10^8 at N = 10,000, about 20 GB).  Instead one ``SharedBase``
holds the N entries once, and each member's ``MemberTable.members`` is an ``Overlay``: its own
entries (members it has heard news about) over the shared ones.  The table copies a shared
entry into its own before it changes it (``MemberTable.apply``), so a shared entry is never
written and every member still applies every rule to its own state.  The sorted live ring is
shared the same way until the member's live set first changes.

A push-pull from such a table that fits in one page (antientropy.py, rule 1a) carries
``SharedRecords``: a plain list to an encoder, which also
says which records are the sender's own and which shared keys it hid, so that a receiver over
the same base walks only the records that can differ from what it shows (``differing``), not
all N (antientropy.py).

Overlay invariant: ``hidden`` holds the shared keys that the overlay does not show through
(deleted here, or shadowed by an entry of its own), so the view is own + (base - hidden),
a disjoint union.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from gossipd.core.gossip_messages import encode_record


class Overlay(dict):
    """A dict of its own entries over a shared read-only ``base`` dict."""

    __slots__ = ("base", "hidden")

    def __init__(self, base: dict[Any, Any], hidden: set[Any]) -> None:
        super().__init__()
        self.base = base
        self.hidden = {k for k in hidden if k in base}

    def __missing__(self, key: Any) -> Any:
        if key in self.hidden:
            raise KeyError(key)
        return self.base[key]

    def get(self, key: Any, default: Any = None) -> Any:
        value = dict.get(self, key, _ABSENT)
        if value is not _ABSENT:
            return value
        if key in self.hidden:
            return default
        return self.base.get(key, default)

    def shared(self, key: Any) -> bool:
        """Is ``key`` shown from the shared base (not yet copied)?"""
        return not dict.__contains__(self, key) and key in self.base and key not in self.hidden

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or (key not in self.hidden and key in self.base)

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self.base:
            self.hidden.add(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: Any) -> None:
        if dict.__contains__(self, key):
            dict.__delitem__(self, key)
        elif key in self.base and key not in self.hidden:
            self.hidden.add(key)
        else:
            raise KeyError(key)

    def __len__(self) -> int:
        return dict.__len__(self) + len(self.base) - len(self.hidden)

    def __iter__(self) -> Iterator[Any]:
        yield from dict.__iter__(self)
        hidden = self.hidden
        yield from (k for k in self.base if k not in hidden)

    def keys(self) -> Iterator[Any]:  # type: ignore[override]
        return iter(self)

    def values(self) -> Iterator[Any]:  # type: ignore[override]
        yield from dict.values(self)
        hidden = self.hidden
        yield from (v for k, v in self.base.items() if k not in hidden)

    def items(self) -> Iterator[tuple[Any, Any]]:  # type: ignore[override]
        yield from dict.items(self)
        hidden = self.hidden
        yield from ((k, v) for k, v in self.base.items() if k not in hidden)


_ABSENT = object()


class SharedRecords(list):
    """A push-pull's records from an ``Overlay`` table: its first ``explicit`` records (the
    sender and its own entries), then the shared records of ``base`` whose keys are not in
    ``hidden`` (the sender's, frozen when sent), in the base's order.  To an encoder or any
    other reader, a plain list.  A receiver whose table is an Overlay of the same base already
    shows every shared record whose key it does not hide: only ``differing`` can be news."""

    __slots__ = ("base", "explicit", "hidden")

    def __init__(self, explicit: list[Any], base: SharedBase, hidden: frozenset[Any]) -> None:
        super().__init__(explicit)
        # The shared records but the hidden ones: slices between the hidden positions (a
        # member hides few keys), not a test per record.
        shared = base.record_list()
        start = 0
        for i in sorted(base.position[k] for k in hidden):  # hidden keys are base keys
            self.extend(shared[start:i])
            start = i + 1
        self.extend(shared[start:])
        self.base = base
        self.explicit = len(explicit)
        self.hidden = hidden

    def differing(self, hidden: AbstractSet[Any]) -> list[Any]:
        """The records, in this list's order, that a table showing own + (base - ``hidden``)
        may not already hold: the explicit ones, and the shared ones of keys it hides."""
        shared = self.base.record_map()
        keys = sorted(hidden - self.hidden, key=self.base.position.__getitem__)
        return [*self[: self.explicit], *(shared[k] for k in keys)]


class SharedBase:
    """N members known alive at incarnation 0: the entries, their checksum contributions'
    XOR and the sorted names, built once for every simulated member."""

    __slots__ = (
        "_raws",
        "_record_list",
        "_records",
        "members",
        "position",
        "raws_bytes",
        "ring",
        "xor",
    )

    def __init__(self, members: dict[str, Any], xor: int) -> None:
        self.members = members
        self.xor = xor
        self.ring = sorted(members)
        self.position = {k: i for i, k in enumerate(members)}
        self._records: dict[str, Any] | None = None
        self._record_list: list[Any] = []
        self._raws: dict[str, Any] | None = None
        self.raws_bytes = 0  # their total length, once raws() has built them

    def record_map(self) -> dict[str, Any]:
        """Each shared entry's push-pull record, by key (built once)."""
        if self._records is None:
            self._records = {k: m.record() for k, m in self.members.items()}
            self._record_list = list(self._records.values())
        return self._records

    def record_list(self) -> list[Any]:
        """The shared entries' push-pull records, in the base's order (``position``)."""
        self.record_map()
        return self._record_list

    def raws(self) -> dict[str, Any]:
        """Every shared entry's push-pull record, encoded (msgspec.Raw; built once): the
        pages of a push-pull too large for one page, and every push-pull's size."""
        if self._raws is None:
            self._raws = {k: encode_record(r) for k, r in self.record_map().items()}
            self.raws_bytes = sum(len(r) for r in self._raws.values())
        return self._raws
