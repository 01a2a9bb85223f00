"""Restores that change a model's layout: `Stack` (per-layer leaves into one stacked
leaf, for a scanned model) and `Unstack` (rows of a stacked leaf into per-layer leaves).

Both are planned on paths, shapes and dtypes alone (`plan_stack`, `plan_unstack`), so
`load` reports every misfit in its one error before anything is read; then
`read_layouts` reads exactly the bytes the result needs: each layer, or each row of
a stacked leaf, once in all, and of a sharded target only this process's slices,
within the host memory budget.
"""

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._chunks import Region
from .._errors import TransformError
from .._formats._convert import aligned_empty, checked_astype
from .._leaf import ArrayLeaf, Leaf
from .._progress import advance, unreported
from .._storage import reading
from .._tree import describe_like, is_array_like
from .._window import Task, check_allocation, host_memory_budget, read_window, run_windowed
from ._place import global_array, slice_key
from ._source import Source

LAYER = "{i}"  # where a `Stack` template puts the layer index
# What one task of an `Unstack` window reads at most (more where a read costs more): a
# window's pieces are read in parallel.
PIECE_BYTES = 4 << 20
MAX_NAMED = 8  # layers an error lists by name


@dataclasses.dataclass(frozen=True)
class Stack:
    """A `load` transform: the new leaf, whose leading axis has length N, is the stack
    over ``i`` in ``range(N)`` of the original leaves at ``original_key`` with ``{i}``
    replaced by ``i``. For a scanned model (blocks stacked with `eqx.filter_vmap` and
    run with `jax.lax.scan`) restored from per-layer weights.

    Each layer is read once, straight into the stacked result; a target sharded along
    any axis reads only this process's slices of each layer.

    **Arguments:**

    - `original_key`: the layers' path, with ``{i}`` where the layer index goes;
      backreferences (``\\1``, ``\\g<name>``) refer to the rule's regex groups.

    ```python
    eqxckpt.save("per_layer", {"blocks": [{"w": np.full(3, i, np.float32)} for i in range(4)]}, overwrite=True)
    like = {"blocks": {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}}  # a scanned model's skeleton
    transforms = {r"blocks/(.*)": eqxckpt.Stack(r"blocks/{i}/\\1")}
    eqxckpt.load("per_layer", like, transforms=transforms)["blocks"]["w"][:, 0]  # np.array([0.0, 1.0, 2.0, 3.0])
    ```
    """

    original_key: str

    def __post_init__(self) -> None:
        if not isinstance(self.original_key, str) or LAYER not in self.original_key:
            raise TransformError(
                f"Stack({self.original_key!r}): the original key must contain {LAYER!r} where the layer index goes, "
                "e.g. Stack(r'blocks/{i}/\\1')."
            )


@dataclasses.dataclass(frozen=True)
class Unstack:
    """A `load` transform: the new leaf is row ``index`` of the stacked original leaf at
    ``original_key``. For a per-layer model restored from a scanned model's weights.

    The rows a restore needs of one stacked leaf are read together, so the stacked
    leaf is read about once in all, not once per row.

    **Arguments:**

    - `original_key`: the stacked leaf's path; backreferences refer to the rule's groups.
    - `index`: the row, an int or a backreference (``r"\\1"``) to a group holding one.

    ```python
    eqxckpt.save("stacked", {"blocks": {"w": np.arange(8.0).reshape(4, 2)}}, overwrite=True)
    like = {"blocks": [{"w": np.zeros(2)} for _ in range(4)]}  # a per-layer model's
    transforms = {r"blocks/(\\d+)/(.*)": eqxckpt.Unstack(r"blocks/\\2", index=r"\\1")}
    eqxckpt.load("stacked", like, transforms=transforms)["blocks"][3]["w"]  # np.array([6.0, 7.0])
    ```
    """

    original_key: str
    index: int | str

    def __post_init__(self) -> None:
        if not isinstance(self.original_key, str):
            raise TransformError(f"Unstack: original_key must be a string (a path), got {self.original_key!r}.")
        if isinstance(self.index, bool) or not isinstance(self.index, (int, str)):
            raise TransformError(
                f"Unstack({self.original_key!r}, index={self.index!r}): index must be an int or a backreference "
                "such as r'\\1'."
            )

    def row(self, match: re.Match, path: str) -> int:
        """The row this rule takes for the new leaf at ``path`` (matched by ``match``)."""
        if isinstance(self.index, int):
            return self.index
        try:
            text = match.expand(self.index)
        except (re.error, IndexError) as e:
            raise TransformError(
                f"Unstack index {self.index!r} cannot be applied to {path!r}: {e}. Check the backreferences against "
                "the regex's groups."
            ) from None
        try:
            if not (text.isascii() and text.isdigit()):  # int() would take "١" or " 1" too
                raise ValueError(text)
            return int(text)
        except ValueError:
            raise TransformError(
                f"Unstack index {self.index!r} gives {text!r} for {path!r}, which is not a row number."
            ) from None


def layer_keys(template: str, count: int) -> list[str]:
    """The original keys of layers ``0 .. count - 1`` of a `Stack` template."""
    return [template.replace(LAYER, str(i)) for i in range(count)]


# -- planning -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A new leaf read as the stack of ``layers``; ``leaf`` describes it as if stored so."""

    leaf: ArrayLeaf
    layers: tuple[ArrayLeaf, ...]


@dataclasses.dataclass(frozen=True)
class Row:
    """A new leaf read as row ``index`` of ``stacked``; ``leaf`` describes it as if stored so."""

    leaf: ArrayLeaf
    stacked: ArrayLeaf
    index: int


Layout = Stacked | Row


def _originals(layout: Layout) -> tuple[ArrayLeaf, ...]:
    """The stored leaves a layout is read from."""
    return layout.layers if isinstance(layout, Stacked) else (layout.stacked,)


def _virtual(origin: ArrayLeaf, path: str, shape: tuple[int, ...]) -> ArrayLeaf:
    """A leaf of ``origin``'s dtype and kind at ``path`` with ``shape`` (never stored, so no digest)."""
    keys = tuple(("dict", part) for part in path.split("/"))
    return dataclasses.replace(origin, path=path, keys=keys, shape=shape, digest=None, offset=None, arrays=None)


def plan_stack(
    path: str,
    template: str,
    target: Any,
    by_key: dict[str, Leaf],
    strict: bool,
    cast: bool,
    origin: Callable[[str], str] | None = None,
) -> Stacked | str:
    """How the new leaf at ``path`` is stacked from the layers at ``template``, or why it cannot be.
    ``origin`` gives a layer's name in its format, for the message (`Source.origin`)."""
    if not is_array_like(target) or not np.shape(target):
        return f"Stack({template!r}) needs an array with a leading layer axis in `like`, found {describe_like(target)}"
    count = np.shape(target)[0]
    keys = layer_keys(template, count)
    absent = [key for key in keys if key not in by_key]
    if absent:
        return (
            f"Stack({template!r}) stacks {count} layers for {describe_like(target)}, but the checkpoint has no "
            f"{_named(absent)}"
        )
    layers = [by_key[key] for key in keys]
    odd = [(key, leaf) for key, leaf in zip(keys, layers) if not isinstance(leaf, ArrayLeaf)]
    if odd:
        return f"Stack({template!r}) stacks arrays; {', '.join(f'{k!r} is {v.describe()}' for k, v in odd[:MAX_NAMED])}"
    arrays = [leaf for leaf in layers if isinstance(leaf, ArrayLeaf)]
    # With cast=True each layer is cast to `like`'s dtype as it is read: stored dtypes may differ.
    differ = {(leaf.shape, None if cast else leaf.dtype) for leaf in arrays}
    if len(differ) > 1:
        kinds: dict[str, list[str]] = {}
        for key, leaf in zip(keys, arrays):
            kinds.setdefault(leaf.describe(), []).append(f"{key!r}" + _stored_as(leaf, key, origin))
        why = "shape" if cast else "shape or dtype"
        return f"Stack({template!r}): the layers differ in {why}: " + "; ".join(
            f"{described} at {', '.join(at[:MAX_NAMED])}" + (" ..." if len(at) > MAX_NAMED else "")
            for described, at in kinds.items()
        )
    extra = layer_keys(template, count + 1)[-1]
    if strict and extra in by_key:
        total = count + 1
        while template.replace(LAYER, str(total)) in by_key:
            total += 1
        return (
            f"Stack({template!r}): `like` stacks {count} layers ({describe_like(target)}), but the checkpoint has "
            f"{total} ({keys[0] if keys else extra!r} to {template.replace(LAYER, str(total - 1))!r}); pass "
            "strict=False to restore the first layers only"
        )
    if not count:
        return "Stack of no layers: `like`'s leading axis has length 0"
    for dtype in dict.fromkeys(leaf.dtype for leaf in arrays):  # each stored dtype's cast checked
        first = next(leaf for leaf in arrays if leaf.dtype == dtype)
        if (problem := _virtual(first, path, (count, *first.shape)).mismatch(target, cast)) is not None:
            return f"{problem} (stacked from {_named(keys)})"
    leaf = _virtual(arrays[0], path, (count, *arrays[0].shape))
    if len({layer.dtype for layer in arrays}) > 1:  # read into `like`'s dtype, each layer cast on its way
        leaf = dataclasses.replace(leaf, dtype=np.dtype(target.dtype).name)
    return Stacked(leaf, tuple(arrays))


def plan_unstack(path: str, key: str, index: int, target: Any, by_key: dict[str, Leaf], cast: bool) -> Row | str:
    """How the new leaf at ``path`` is read as row ``index`` of the leaf at ``key``, or why it cannot be."""
    stacked = by_key.get(key)
    if stacked is None:
        return f"Unstack({key!r}, index={index}): the checkpoint has no {key!r}"
    if not isinstance(stacked, ArrayLeaf) or not stacked.shape:
        return f"Unstack({key!r}) needs a stacked array, found {stacked.describe()} at {key!r}"
    if not 0 <= index < stacked.shape[0]:
        return f"Unstack({key!r}, index={index}): index out of range for {key!r} ({stacked.describe()}, rows 0 to {stacked.shape[0] - 1})"
    leaf = _virtual(stacked, path, stacked.shape[1:])
    if (problem := leaf.mismatch(target, cast)) is not None:
        return f"{problem} (row {index} of {key!r}, {stacked.describe()})"
    return Row(leaf, stacked, index)


def unrestored_rows(rows: Sequence[tuple[str, Row]]) -> list[tuple[str, str]]:
    """For each stacked leaf some rows were planned from, the rows no new leaf takes, as
    ``(path, what)`` problems (a strict restore refuses them: `like` has fewer layers)."""
    taken: dict[str, tuple[ArrayLeaf, set[int], list[str]]] = {}
    for path, row in rows:
        entry = taken.setdefault(row.stacked.path, (row.stacked, set(), []))
        entry[1].add(row.index)
        entry[2].append(path)
    problems = []
    for stacked_path, (stacked, indices, paths) in taken.items():
        left = [i for i in range(stacked.shape[0]) if i not in indices]
        if left:
            problems.append(
                (
                    paths[0],
                    f"the checkpoint stacks {stacked.shape[0]} rows in {stacked_path!r} ({stacked.describe()}), but "
                    f"`like` takes {len(indices)} of them (not rows {_listed(left)}); pass strict=False to restore "
                    "these rows only",
                )
            )
    return problems


def _stored_as(leaf: Leaf, key: str, origin: Callable[[str], str] | None) -> str:
    """`` (stored as name)`` where the leaf's name in its format is not ``key``."""
    name = leaf.path if origin is None else origin(leaf.path)
    return "" if name == key else f" (stored as {name})"


def _named(keys: Sequence[str]) -> str:
    listed = ", ".join(repr(k) for k in keys[:MAX_NAMED])
    return listed + (f" and {len(keys) - MAX_NAMED} more" if len(keys) > MAX_NAMED else "")


def _listed(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices[:MAX_NAMED])) + (" ..." if len(indices) > MAX_NAMED else "")


# -- reading --------------------------------------------------------------------------

Key = tuple[tuple[int, int], ...]  # a block: (start, stop) per dimension


def _blocks(target: Any, shape: tuple[int, ...]) -> dict[Key, list[Any]] | None:
    """This process's distinct blocks of ``target`` and the devices holding each; None
    when the whole array goes to one device (or to numpy)."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or (len(sharding.device_set) == 1 and sharding.is_fully_addressable):
        return None
    blocks: dict[Key, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = slice_key(index, shape)
        blocks.setdefault(key, []).append(device)
    return blocks


def _bounds(keys: Sequence[Key]) -> Key:
    """The smallest block holding every one of ``keys``."""
    return tuple((min(k[d][0] for k in keys), max(k[d][1] for k in keys)) for d in range(len(keys[0])))


def _region(key: Key, within: Key | None = None) -> tuple[slice, ...]:
    """``key`` as slices, relative to the start of ``within``."""
    starts = [0] * len(key) if within is None else [a for a, _ in within]
    return tuple(slice(a - s, b - s) for (a, b), s in zip(key, starts))


def _placed(blocks: dict[Key, list[Any]], data: dict[Key, np.ndarray]) -> dict[Any, Any]:
    """Each of ``data``'s blocks put on the devices that hold it, and let go of on the host."""
    import jax

    arrays = {}
    for key in list(data):
        for device in blocks[key]:
            arrays[device] = jax.device_put(data[key], device)
            arrays[device].block_until_ready()  # transferred: the host's block can go
        del data[key]
    return arrays


def _assembled(shape: tuple[int, ...], target: Any, arrays: dict[Any, Any]) -> Any:
    """The global array of ``target``'s sharding from this process's devices' arrays."""

    devices = target.sharding.addressable_devices_indices_map(shape)
    return global_array(shape, target.sharding, [arrays[d] for d in devices], target.dtype)


def _staged(blocks: dict[Key, list[Any]], itemsize: int) -> list[list[Key]]:
    """``blocks`` in groups whose host buffers fit the host memory budget together (one
    block at least). A block for CPU devices costs nothing: it becomes the result."""
    groups: list[list[Key]] = [[]]
    staged, budget = 0, host_memory_budget()
    for key, devices in blocks.items():
        cost = 0 if all(d.platform == "cpu" for d in devices) else math.prod(b - a for a, b in key) * itemsize
        if groups[-1] and staged + cost > budget:
            groups.append([])
            staged = 0
        groups[-1].append(key)
        staged += cost
    return groups


class _Reader:
    """Reads boxes of the original leaves: small ones (packed into shared chunks in an
    eqxckpt checkpoint) read beforehand in one batch, so each shared chunk is read once;
    the others straight into their buffers (`Source.read_into`)."""

    def __init__(self, source: Source, layouts: Sequence[Layout]):
        self.source = source
        originals = {leaf.path: leaf for layout in layouts for leaf in _originals(layout)}
        small = [leaf for leaf in originals.values() if leaf.offset is not None]
        wanted = [(leaf, leaf.host_target()) for leaf in small]  # as stored, in host memory
        with unreported():  # counted as the results they fill
            self._read = {leaf.path: value for leaf, value in zip(small, source.read(wanted))} if wanted else {}
        source.prepare_reads([leaf for leaf in originals.values() if leaf.offset is None])

    def into(self, leaf: ArrayLeaf, region: Region, out: np.ndarray) -> None:
        if leaf.path in self._read:
            out[...] = self._read[leaf.path][region]
        else:
            self.source.read_into(leaf, region, out)


def read_layouts(source: Source, wanted: Sequence[tuple[Layout, Any]]) -> list[Any]:
    """Read each planned layout into its target (an array or `jax.ShapeDtypeStruct` of
    `like`, whose sharding is honoured), each original byte once: the rows of one
    stacked leaf are read together, a window of rows at a time. Layers and windows of
    every leaf are read in one stream of I/O tasks, many in flight.

    **Returns:** the values, in the order of ``wanted``.
    """
    whole = [
        (i, layout, target) for i, (layout, target) in enumerate(wanted) if _blocks(target, layout.leaf.shape) is None
    ]
    nbytes = sum(layout.leaf.nbytes for _, layout, _ in whole)
    check_allocation(nbytes, f"Restoring {len(wanted)} stacked or unstacked leaves from {source.location}")
    reader = _Reader(source, [layout for layout, _ in wanted])
    values: list[Any] = [None] * len(wanted)
    rows: dict[str, list[tuple[int, Row, Any]]] = {}
    streams: list[Iterator[Task]] = []
    for i, layout, target in whole:
        if isinstance(layout, Stacked):
            streams.append(_stacked_tasks(reader, layout, target, lambda value, i=i: values.__setitem__(i, value)))
    for i, (layout, target) in enumerate(wanted):
        if isinstance(layout, Row):
            rows.setdefault(layout.stacked.path, []).append((i, layout, target))
    for of_one_leaf in rows.values():
        streams.append(_row_tasks(reader, of_one_leaf, values))
    run_windowed(itertools.chain.from_iterable(streams), read_window(nbytes))
    for i, (layout, target) in enumerate(wanted):  # sharded: a leaf at a time, blocks staged within the budget
        if isinstance(layout, Stacked) and values[i] is None:
            values[i] = _read_sharded_stack(reader, layout, target)
            advance(layout.leaf.nbytes)
    return values


def _stacked_tasks(reader: _Reader, stacked: Stacked, target: Any, done: Callable[[Any], None]) -> Iterator[Task]:
    """The tasks that read a `Stack`'s layers straight into its result (made when the
    stream reaches them); the last one finishes it into ``target`` and hands it to ``done``."""
    leaf = stacked.leaf
    out = aligned_empty(leaf.shape, np.dtype(leaf.dtype))  # aligned: the jax array adopts it
    tasks = list(_layer_tasks(reader, stacked, {tuple((0, n) for n in leaf.shape): out}))

    def finished(_: Any) -> None:
        with reading(leaf):
            done(leaf.finish(out, target))
        advance(leaf.nbytes)

    *first, (nbytes, work, _) = tasks
    yield from first
    yield nbytes, work, finished


def _read_sharded_stack(reader: _Reader, stacked: Stacked, target: Any) -> Any:
    """A `Stack` into a sharded target: each layer read once (only this process's slices of
    it) into its blocks, which are put on their devices a group at a time."""
    leaf = stacked.leaf
    blocks = _blocks(target, leaf.shape)
    assert blocks is not None
    dtype = np.dtype(target.dtype)
    arrays = {}
    for group in _staged(blocks, dtype.itemsize):  # blocks staged for other devices: within the budget
        shapes = {key: tuple(b - a for a, b in key) for key in group}
        check_allocation(
            sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize, f"Restoring {leaf.path!r}"
        )
        data = {key: aligned_empty(shape, dtype) for key, shape in shapes.items()}
        run_windowed(_layer_tasks(reader, stacked, data), read_window(leaf.nbytes))
        arrays.update(_placed(blocks, data))
    return _assembled(leaf.shape, target, arrays)


def _layer_tasks(reader: _Reader, stacked: Stacked, data: dict[Key, np.ndarray]) -> Iterator[Task]:
    """Tasks that read, of each layer, the part that the blocks ``data`` (of the stacked
    shape) hold, once, into each of them (cast to their dtype): straight into a block that
    is the only one holding it, in the layer's stored dtype."""
    for i, layer in enumerate(stacked.layers):
        holding = [key for key in data if key[0][0] <= i < key[0][1]]
        if not holding:
            continue
        bounds = _bounds([key[1:] for key in holding])
        stored_dtype = np.dtype(layer.dtype)
        nbytes = math.prod(b - a for a, b in bounds) * stored_dtype.itemsize

        def work(i: int = i, layer: ArrayLeaf = layer, holding: list[Key] = holding, bounds: Key = bounds) -> None:
            region = _region(bounds)
            only, stored_dtype = data[holding[0]], np.dtype(layer.dtype)
            if len(holding) == 1 and only.dtype == stored_dtype and holding[0][1:] == bounds:
                # Its slab of the block: C-contiguous (a view, even 0-d).
                reader.into(layer, region, only[i - holding[0][0][0], ...])
                return
            part = aligned_empty(tuple(b - a for a, b in bounds), stored_dtype)
            reader.into(layer, region, part)
            for key in holding:
                block = data[key]
                block[i - key[0][0]] = checked_astype(part[_region(key[1:], bounds)], block.dtype, stacked.leaf.path)

        yield nbytes, work, None


def _row_tasks(reader: _Reader, wanted: list[tuple[int, Row, Any]], values: list[Any]) -> Iterator[Task]:
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
    for i, row, target in sorted(wanted, key=lambda item: item[1].index):
        blocks = _blocks(target, row_shape)
        bounds = _bounds(list(blocks)) if blocks else tuple((0, n) for n in row_shape)
        plans.append((i, row, target, blocks, bounds))
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

            def work(a: int = a, b: int = b, window: np.ndarray = window, bounds: Key = bounds, low: int = low) -> None:
                reader.into(stacked, (slice(a, b), *_region(bounds)), window[a - low : b - low])

            then = (lambda _, group=group, window=window: _settle(group, window, values)) if b == high else None
            yield (b - a) * row_bytes, work, then


def _settle(group: list, window: np.ndarray, values: list[Any]) -> None:
    """Each row of ``group`` from the ``window`` read for it, into its target."""
    low = group[0][1].index
    kept = [row.index for _, row, *_ in group] == list(range(low, low + len(window)))
    for i, row, target, blocks, bounds in group:
        part = window[row.index - low, ...]  # a view, even of a 0-d row
        if blocks is None:
            if not kept:
                part = _copied(part)
            with reading(row.leaf):
                values[i] = row.leaf.finish(part, target)
        else:
            data = {key: checked_astype(part[_region(key, bounds)], target.dtype, row.leaf.path) for key in blocks}
            values[i] = _assembled(row.leaf.shape, target, _placed(blocks, data))
        advance(row.leaf.nbytes)


def _copied(data: np.ndarray) -> np.ndarray:
    """A copy of ``data`` in a buffer of its own (aligned: a jax array adopts it)."""
    out = aligned_empty(data.shape, data.dtype)
    out[...] = data
    return out
