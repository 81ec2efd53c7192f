"""Writes whose items are first made ready on the writer thread (`Writer.submit(..., ready=)`:
their arrays fetched from the device), the items queued in a row made ready together."""

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A write whose item is first made ready (`Writer.submit(..., ready=)`), and where it
    has one, the write of several at once (`Writer.submit(..., many=)`)."""

    write: Callable[[Any], None]
    ready: Callable[[list[Any]], list[Any]]
    many: "Many | None" = None


@dataclasses.dataclass(frozen=True)
class Many:
    """The write of several items made ready (`Writer.submit(..., many=)`): `write(values)`
    writes, in order and at once, what `ready` made of items queued in a row whose
    `joins(value)` is the same and not None (the run they write to, say)."""

    joins: Callable[[Any], Any]
    write: Callable[[list[Any]], None]


UNSET = object()
# What `ready` makes of an item that needs no write: its write is skipped (done at once).
NOTHING = object()


@dataclasses.dataclass(frozen=True)
class _Failed:
    error: BaseException


class Slot:
    """The item of a `Prepared` write, and (once made) what `ready` made of it. (A plain
    class: one is made per submitted write.)"""

    __slots__ = ("item", "value")

    def __init__(self, item: Any):
        self.item, self.value = item, UNSET

    def get(self) -> Any:
        if isinstance(self.value, _Failed):
            raise self.value.error
        return self.value


def unready(write: Any, item: Any) -> bool:
    """Whether a queued write has an item still to make ready."""
    return isinstance(write, Prepared) and item.value is UNSET


def done(write: Any, item: Any) -> bool:
    """Whether a queued write was made ready as `NOTHING`: nothing is left to do."""
    return isinstance(write, Prepared) and item.value is NOTHING


def batch(write: Any, item: Any, queued: Iterable[tuple[Any, ...]]) -> list[Slot]:
    """The slots to make ready with `write` (just taken from the queue): its own, with those
    queued behind it that the same `ready` makes; none if it has none to make ready."""
    if not unready(write, item):
        return []
    slots = [item]
    for w, slot, *_ in queued:
        if w != write or slot.value is not UNSET:
            break
        slots.append(slot)
    return slots


def joins(write: Any, item: Any) -> Any:
    """What a queued write made ready joins (`Many.joins`), or None: it is written alone (its
    write has no `Many`, or it is not made ready, or made as `NOTHING`, or failed)."""
    if not isinstance(write, Prepared) or write.many is None:
        return None
    value = item.value
    if value is UNSET or value is NOTHING or isinstance(value, _Failed):
        return None
    return write.many.joins(value)


def fill(ready: Callable[[list[Any]], list[Any]], slots: list[Slot]) -> list[Any]:
    """Fill `slots` with `ready` of their items. An error is the first slot's (raised by its
    write; the others are tried again). Returns the items made ready, which the slots let go
    of (for their submitter's thread to drop: see `Writer.submit`)."""
    items = [slot.item for slot in slots]
    try:
        for slot, value in zip(slots, ready(items), strict=True):
            slot.item, slot.value = None, value
    except BaseException as e:  # noqa: BLE001 (raised by the first slot's write)
        slots[0].value = _Failed(e)
    return items
