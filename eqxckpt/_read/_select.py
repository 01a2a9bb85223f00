"""Basic numpy indices of a stored array (what `LazyArray` indexing takes), normalised
so that eqxckpt's chunk reader can read exactly the chunks they touch."""

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._chunks import Region

# Per index position: None (a new axis), an int (a dimension taken at one index), or the
# indices a dimension is taken at, in the order of the result (a negative step: descending).
Item = None | int | range


@dataclasses.dataclass(frozen=True)
class Selection:
    """A basic numpy index of an array of ``shape``, normalised.

    ```python
    selection = Selection.of((1, slice(None, None, -2)), (3, 5))
    selection.shape  # (3,)
    selection.box()  # (range(1, 2), range(0, 6, 2)): rows 1, columns 0, 2, 4
    ```
    """

    items: tuple[Item, ...]

    @classmethod
    def of(cls, index: Any, shape: Sequence[int]) -> "Selection":
        """``index`` (ints, slices, ``...`` and ``None``, as numpy takes them) into an array of
        ``shape``; an `IndexError` as numpy's for one out of range, `NotImplementedError` for
        array indices."""
        index = index if isinstance(index, tuple) else (index,)
        for entry in index:
            if _advanced(entry):
                raise NotImplementedError(
                    "A LazyArray takes basic indices (ints, slices, ..., None); index the array get() returns "
                    "with arrays or masks."
                )
        ellipses = sum(entry is Ellipsis for entry in index)
        if ellipses > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        real = sum(entry is not None and entry is not Ellipsis for entry in index)
        if real > len(shape):
            raise IndexError(f"too many indices for array: array is {len(shape)}-dimensional, but {real} were indexed")
        if not ellipses:
            index = (*index, Ellipsis)
        at = index.index(Ellipsis)
        index = (*index[:at], *[slice(None)] * (len(shape) - real), *index[at + 1 :])
        items: list[Item] = []
        dims = iter(shape)
        for entry in index:
            if entry is None:
                items.append(None)
                continue
            n = next(dims)
            if isinstance(entry, slice):
                items.append(range(*entry.indices(n)))
                continue
            try:
                i = operator.index(entry)
            except TypeError:
                raise IndexError(
                    "only integers, slices (`:`), ellipsis (`...`) and numpy.newaxis (`None`) are valid indices"
                ) from None
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for axis {len(items)} with size {n}")
            items.append(i % n)
        return cls(tuple(items))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the selected array."""
        return tuple(1 if item is None else len(item) for item in self.items if not isinstance(item, int))

    def box(self) -> tuple[range, ...]:
        """Per dimension of the array, the indices read, ascending."""
        return tuple(
            range(item, item + 1) if isinstance(item, int) else item if item.step > 0 else item[::-1]
            for item in self.items
            if item is not None
        )

    def covers(self, shape: Sequence[int]) -> bool:
        """Whether it selects all of an array of ``shape`` as it is (no dimension taken,
        added, reversed or skipped)."""
        items = self.items
        return len(items) == len(shape) and all(
            isinstance(item, range) and item == range(n) for item, n in zip(items, shape)
        )

    def take(self, data: np.ndarray, start: Sequence[int] = ()) -> np.ndarray:
        """The selection from ``data``: the whole array, or (``start``: its first indices,
        one per leading dimension) the part of it from there on that holds `box`."""
        start = (*start, *[0] * (len(self.box()) - len(start)))
        boxed = data[tuple(slice(r.start - s, r.stop - s, r.step) for r, s in zip(self.box(), start))]
        return self.finish(boxed)

    def finish(self, boxed: np.ndarray) -> np.ndarray:
        """The selection, from ``boxed`` (the array read for `box`)."""
        index = tuple(
            None if item is None else 0 if isinstance(item, int) else slice(None, None, 1 if item.step > 0 else -1)
            for item in self.items
        )
        return boxed[index]

    def sub(self, part: Region) -> "Selection":
        """The selection of ``part`` (slices from 0, step 1) of what this one selects."""
        parts = iter(part)
        items: list[Item] = []
        for item in self.items:
            if isinstance(item, int):
                items.append(item)
                continue
            taken = next(parts)
            if item is None:
                assert (taken.start, taken.stop) == (0, 1), taken
                items.append(None)
            else:
                items.append(item[taken])
        return Selection(tuple(items))


def _advanced(entry: Any) -> bool:
    """Whether numpy would take ``entry`` as an array index (or a mask)."""
    if entry is None or entry is Ellipsis or isinstance(entry, slice):
        return False
    if isinstance(entry, (bool, np.bool_, list, tuple)):
        return True
    return np.ndim(entry) > 0 or getattr(entry, "dtype", None) == np.bool_
