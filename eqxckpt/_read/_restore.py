"""The restore engine: every value a restore reads, from any source, is read here.

A restore's items are stored leaves (`Source.read`) and the new leaves of a layout
(`Stack`'s stacks of layers, `Unstack`'s rows of a stacked leaf). Each is read either
whole into host memory, or placed onto its devices a band of its blocks at a time
(`Placement`): a target sharded over several devices, or a leaf larger than the host
memory budget bound for a device that is not the host's. Whole stored leaves are read by
the format (`Source._fetch`); placed leaves, layers and rows by boxes
(`Source._read_boxes`). Layouts read each original byte once: the layers of a stack, or a
window of rows of a stacked leaf shared by its rows, in one stream of I/O tasks. Data
replicated across processes is read once in all (`read_once`), layouts included in its
agreement. Casts, checks, digests, progress and memory limits are the same for all.
"""

import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import CheckpointError, CorruptCheckpointError
from .._formats._convert import Adoption, Adoptions, aligned_empty, checked_astype
from .._leaf import ArrayLeaf, StoredLeaf
from .._progress import advance, unreported
from .._storage import reading
from .._window import Task, check_allocation, host_memory_budget, read_window, run_windowed, start_jax
from ._place import Block, PlacedDigest, Placement, Reader, block_of, bounding_block, on_host, region_of
from ._read_once import read_once
from ._restack import Layout, Row, Stacked, originals

if TYPE_CHECKING:
    from ._source import Boxes, Source

# What one task of an `Unstack` window reads at most (more where a read costs more): a
# window's pieces are read in parallel.
PIECE_BYTES = 4 << 20

Item = tuple[StoredLeaf | Layout, Any]  # what is read (a stored leaf, a layout) and its target


def restore(source: "Source", wanted: Sequence[Item], together: bool = False) -> list[Any]:
    """Read every item of a planned restore into its target: `load`'s one read.

    **Arguments:**

    - `source`: what is read.
    - `wanted`: ``(what, target)`` pairs: a `StoredLeaf` of ``source`` or a planned
      `Stacked` or `Row`, and a leaf of `like` (or None: as stored).
    - `together`: every process of the job restores this (`read_once`).

    **Returns:** the values, in the order of ``wanted``.
    """

    def read_here(items: Sequence[Item]) -> list[Any]:
        values: list[Any] = [None] * len(items)
        stored: dict[int, tuple[StoredLeaf, Any]] = {}
        layouts: dict[int, tuple[Layout, Any]] = {}
        for i, (what, target) in enumerate(items):
            if isinstance(what, StoredLeaf):
                stored[i] = (what, target)
            else:
                layouts[i] = (what, target)
        for i, value in zip(stored, source.read(list(stored.values())) if stored else []):
            values[i] = value
        for i, value in zip(layouts, _read_layouts(source, list(layouts.values()))):
            values[i] = value
        return values

    return read_once(source, wanted, together, read_here)


def placement(leaf: StoredLeaf, target: Any) -> Placement | None:
    """How ``leaf`` goes onto ``target``'s devices a band at a time (where it can be read by
    boxes), or None where it is read whole: a target sharded over several devices, or on
    one device a leaf larger than the host memory budget that would otherwise be held
    whole on the host (a device other than a CPU, or a cast). Planned before anything is
    read: a sharding that does not fit the shape is the caller's mistake (JAX's own
    error), not a damaged checkpoint."""
    placed = leaf.placement(target)
    if placed is None:
        return None
    sharding, dtype = placed
    budget = host_memory_budget()
    if len(sharding.device_set) == 1 and sharding.is_fully_addressable:
        if leaf.nbytes <= budget or (on_host(sharding.device_set) and dtype == np.dtype(leaf.dtype)):
            return None
    elif not leaf.can_shard(sharding):
        return None
    return Placement(leaf.data_shape, sharding, np.dtype(leaf.dtype), dtype, budget)


def _placed(leaf: StoredLeaf, target: Any, placement: Placement, read: Reader, window: int, rows: int = 1) -> Any:
    """``leaf`` read by ``read`` onto ``target``'s devices (its digest fed as it is placed)."""
    with reading(leaf):
        digest = PlacedDigest.of(leaf, placement)
        run = functools.partial(placement.run, read=read, window=window, rows=rows, seen=digest)
        value = leaf.assemble(target, run)
        if digest is not None:
            digest.check()
    advance(leaf.nbytes)
    return value


def read_stored(source: "Source", wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
    """`Source.read` of checked pairs: leaves placed by boxes where the format reads parts
    (`Source.chunk_shapes`), the others fetched whole together."""
    start_jax()
    values: list[Any] = [None] * len(wanted)
    planned = {i: p for i, (leaf, target) in enumerate(wanted) if (p := placement(leaf, target)) is not None}
    units = dict(zip(planned, source.chunk_shapes([wanted[i][0] for i in planned]))) if planned else {}
    placements = {i: p for i, p in planned.items() if units[i] is not None}  # read by boxes
    whole = [i for i in range(len(wanted)) if i not in placements]

    adoptions = Adoptions()  # jax arrays of leaves read whole, made together at the end

    # A leaf wanted twice may be fetched once: each value but the first gets a copy, as
    # a jax array adopts its buffer and a numpy value of the same buffer could change it.
    handed: set[tuple[int, int]] = set()
    lock = threading.Lock()
    ours: list[BaseException] = []  # raised by the caller's own code, never the format's

    def done(j: int, data: np.ndarray) -> None:
        leaf, target = wanted[whole[j]]
        with lock:
            again = (data.ctypes.data, data.nbytes) in handed
            handed.add((data.ctypes.data, data.nbytes))
        if again and data.nbytes:
            data = data.copy()
        with reading(leaf):
            leaf.check_whole(data)
            values[whole[j]] = leaf.finish(data, target, adoptions)
        try:
            advance(leaf.nbytes)
        except BaseException as e:  # the caller's progress callback: comes through as itself
            ours.append(e)
            raise

    def reserve(nbytes: int) -> None:
        check_allocation(nbytes, f"Restoring {len(wanted)} leaves from {source.location}")

    if whole or not wanted:
        try:
            source._fetch([wanted[i][0] for i in whole], done, reserve)
        except CheckpointError:
            raise
        except Exception as e:  # a format's own failure, raised as it is: named here
            if any(e is mine for mine in ours):
                raise
            pending = [wanted[i][0].path for i in whole if values[i] is None]
            raise CorruptCheckpointError(
                f"Reading leaves {pending[:5]}{' ...' if len(pending) > 5 else ''} of {source.location} failed: "
                f"{type(e).__name__}: {e}. Its files are damaged or unreadable.",
                leaf_path=pending[0] if pending else None,
            ) from e
        adoptions.place()
        for i in whole:
            if isinstance(values[i], Adoption):
                values[i] = values[i].value
    # Then the leaves placed a band at a time, each on its devices before the next is read.
    window = read_window(sum(leaf.nbytes for leaf, _ in wanted))
    for i, placed in placements.items():
        leaf, target = wanted[i]

        def read(boxes: "Boxes", window: int, leaf: StoredLeaf = leaf) -> None:
            source._read_boxes(leaf, [(box, out) for box, out in boxes if out.size], window)

        unit = units[i] or (1,)
        values[i] = _placed(leaf, target, placed, read, window, max(1, unit[0]) if unit else 1)
    return values


# -- layouts ----------------------------------------------------------------------------


class _Originals:
    """Reads boxes of the leaves layouts are read from: those a format reads only whole
    (small ones packed into shared chunks, in an eqxckpt checkpoint) read beforehand in one
    batch, so each is read once; the others straight into their buffers (`Source.read_into`)."""

    def __init__(self, source: "Source", layouts: Sequence[Layout]):
        self.source = source
        leaves = list({leaf.path: leaf for layout in layouts for leaf in originals(layout)}.values())
        units = source.chunk_shapes(leaves) if leaves else []
        whole = [leaf for leaf, unit in zip(leaves, units) if unit is None]
        wanted = [(leaf, leaf.host_target()) for leaf in whole]  # as stored, in host memory
        with unreported():  # counted as the results they fill
            self._read = {leaf.path: value for leaf, value in zip(whole, source.read(wanted))} if wanted else {}

    def checked(self, leaf: ArrayLeaf) -> bool:
        """Whether ``leaf`` was read whole beforehand, its digest checked then."""
        return leaf.path in self._read

    def into(self, leaf: ArrayLeaf, region: tuple[slice, ...], out: np.ndarray) -> None:
        if leaf.path in self._read:
            out[...] = self._read[leaf.path][region]
        else:
            self.source.read_into(leaf, region, out)


def _read_layouts(source: "Source", layouts: Sequence[tuple[Layout, Any]]) -> list[Any]:
    """Read each planned layout into its target, each original byte once: the layers of a
    stack, or the rows of one stacked leaf a window of rows at a time, many in flight. A
    sharded target is placed (`Placement`) from what is read, only this process's blocks."""
    if not layouts:
        return []
    placements = [placement(layout.leaf, target) for layout, target in layouts]
    whole = [layout.leaf.nbytes for (layout, _), p in zip(layouts, placements) if p is None]
    check_allocation(sum(whole), f"Restoring {len(layouts)} stacked or unstacked leaves from {source.location}")
    reader = _Originals(source, [layout for layout, _ in layouts])
    values: list[Any] = [None] * len(layouts)
    streams: list[Iterator[Task]] = []
    rows: dict[str, list[tuple[int, Row, Any, Placement | None]]] = {}
    for i, ((layout, target), placed) in enumerate(zip(layouts, placements)):
        if isinstance(layout, Row):
            rows.setdefault(layout.stacked.path, []).append((i, layout, target, placed))
        elif placed is None:
            streams.append(_stacked_tasks(reader, layout, target, lambda value, i=i: values.__setitem__(i, value)))
    for of_one_leaf in rows.values():
        streams.append(_row_tasks(reader, of_one_leaf, values))
    run_windowed(itertools.chain.from_iterable(streams), read_window(sum(whole)))
    for i, ((layout, target), placed) in enumerate(zip(layouts, placements)):
        if isinstance(layout, Stacked) and placed is not None:  # a leaf at a time, its bands within the budget

            def read(boxes: "Boxes", window: int, layout: Stacked = layout) -> None:
                run_windowed(_layer_tasks(reader, layout, [(block_of(box), out) for box, out in boxes]), window)

            values[i] = _placed(layout.leaf, target, placed, read, read_window(layout.leaf.nbytes))
    return values


def _stacked_tasks(reader: _Originals, stacked: Stacked, target: Any, done: Callable[[Any], None]) -> Iterator[Task]:
    """The tasks that read a `Stack`'s layers straight into its result (made when the
    stream reaches them); the last one finishes it into ``target`` and hands it to ``done``."""
    leaf = stacked.leaf
    out = aligned_empty(leaf.shape, np.dtype(leaf.dtype))  # aligned: the jax array adopts it
    tasks = list(_layer_tasks(reader, stacked, [(tuple((0, n) for n in leaf.shape), out)]))

    def finished(_: Any) -> None:
        with reading(leaf):
            done(leaf.finish(out, target))
        advance(leaf.nbytes)

    *first, (nbytes, work, _) = tasks
    yield from first
    yield nbytes, work, finished


def _layer_tasks(reader: _Originals, stacked: Stacked, blocks: Sequence[tuple[Block, np.ndarray]]) -> Iterator[Task]:
    """Tasks that read, of each layer, the part that ``blocks`` (of the stacked shape, each
    with its buffer) hold, once, into each of them (cast to their dtype): straight into a
    block that is the only one holding it, in the layer's stored dtype."""
    for i, layer in enumerate(stacked.layers):
        holding = [(block, out) for block, out in blocks if block[0][0] <= i < block[0][1]]
        if not holding:
            continue
        bounds = bounding_block([block[1:] for block, _ in holding])
        stored_dtype = np.dtype(layer.dtype)
        nbytes = math.prod(b - a for a, b in bounds) * stored_dtype.itemsize

        def work(i: int = i, layer: ArrayLeaf = layer, holding: list = holding, bounds: Block = bounds) -> None:
            region = region_of(bounds)
            (block, only), stored_dtype = holding[0], np.dtype(layer.dtype)
            # The layer's every byte: its digest is checked (unless it was, read whole beforehand).
            whole = bounds == tuple((0, n) for n in layer.shape) and not reader.checked(layer)
            if len(holding) == 1 and only.dtype == stored_dtype and block[1:] == bounds:
                slab = only[i - block[0][0], ...]  # its slab: C-contiguous (a view, even 0-d)
                reader.into(layer, region, slab)
                if whole:
                    with reading(layer):
                        layer.check_whole(slab)
                return
            part = aligned_empty(tuple(b - a for a, b in bounds), stored_dtype)
            reader.into(layer, region, part)
            if whole:
                with reading(layer):
                    layer.check_whole(part)
            for block, out in holding:
                out[i - block[0][0]] = checked_astype(part[region_of(block[1:], bounds)], out.dtype, stacked.leaf.path)

        yield nbytes, work, None


def _row_tasks(
    reader: _Originals, wanted: list[tuple[int, Row, Any, Placement | None]], values: list[Any]
) -> Iterator[Task]:
    """The tasks that read `Unstack`'s results from one stacked leaf: its rows a window at a
    time (of each row only the part this process's blocks need), every row once, each window
    in pieces read in parallel. Where a window's rows are each restored whole once, they
    keep its buffer (no copy); otherwise each is copied out, so no result shares memory
    with another or holds rows it lacks."""
    stacked = wanted[0][1].stacked
    row_shape = stacked.shape[1:]
    dtype = np.dtype(stacked.dtype)
    row_bytes = math.prod(row_shape) * dtype.itemsize
    plans = []
    for i, row, target, placed in sorted(wanted, key=lambda item: item[1].index):
        bounds = bounding_block(list(placed.devices)) if placed is not None else tuple((0, n) for n in row_shape)
        plans.append((i, row, target, placed, bounds))
    # Every row once, whole: the windows, settled in order, are the stacked leaf's bytes in
    # C order, so its digest is checked as they arrive.
    every_row = [row.index for _, row, *_ in plans] == list(range(stacked.shape[0]))
    whole = all(bounds == tuple((0, n) for n in row_shape) for *_, bounds in plans)
    digesting = stacked.digesting() if every_row and whole and not reader.checked(stacked) else None
    step = reader.source.rows_per_read(stacked)
    window_rows = max(step, host_memory_budget() // max(1, row_bytes) // step * step)
    piece_rows = max(step, -(-PIECE_BYTES // max(1, row_bytes)) // step * step)
    start = 0
    while start < len(plans):
        # Rows that share their part of a row, within one window of rows aligned to what a read costs.
        first = plans[start][1].index
        end = start + 1
        while (
            end < len(plans)
            and plans[end][4] == plans[start][4]
            and plans[end][1].index < first - first % step + window_rows
            and plans[end][1].index // step <= plans[end - 1][1].index // step + 1  # no unread gap
        ):
            end += 1
        group, start = plans[start:end], end
        bounds = group[0][4]
        low, high = group[0][1].index, group[-1][1].index + 1
        window = aligned_empty((high - low, *(b - a for a, b in bounds)), dtype)
        cuts = [low, *range(low - low % piece_rows + piece_rows, high, piece_rows), high]
        for a, b in zip(cuts, cuts[1:]):

            def work(
                a: int = a, b: int = b, window: np.ndarray = window, bounds: Block = bounds, low: int = low
            ) -> None:
                reader.into(stacked, (slice(a, b), *region_of(bounds)), window[a - low : b - low])

            last = start == len(plans)

            def then(_: Any, group: list = group, window: np.ndarray = window, last: bool = last) -> None:
                if digesting is not None:
                    digesting.update(window)
                    if last:
                        with reading(stacked):
                            stacked.check_digest(digesting.value)
                _settle(group, window, values)

            yield (b - a) * row_bytes, work, then if b == high else None


def _settle(group: list, window: np.ndarray, values: list[Any]) -> None:
    """Each row of ``group`` from the ``window`` read for it, into its target: placed from
    the window onto its devices where it is sharded."""
    low = group[0][1].index
    kept = [row.index for _, row, *_ in group] == list(range(low, low + len(window)))
    for i, row, target, placed, bounds in group:
        part = window[row.index - low, ...]  # a view, even of a 0-d row
        if placed is None:
            if not kept:
                part = _copied(part)
            with reading(row.leaf):
                values[i] = row.leaf.finish(part, target)
            advance(row.leaf.nbytes)
            continue

        def read(boxes: "Boxes", window: int, part: np.ndarray = part, bounds: Block = bounds) -> None:
            for box, out in boxes:
                out[...] = part[region_of(block_of(box), bounds)]

        values[i] = _placed(row.leaf, target, placed, read, 0)


def _copied(data: np.ndarray) -> np.ndarray:
    """A copy of ``data`` in a buffer of its own (aligned: a jax array adopts it)."""
    out = aligned_empty(data.shape, data.dtype)
    out[...] = data
    return out
