"""`open` and `Checkpoint`: a read-only, lazy view of a committed eqxckpt checkpoint."""

import asyncio
import functools
import json
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from ._budget import check_allocation, host_memory_budget, read_window
from ._chunks import CHUNK_BYTES, ChunkLayout, Region, read_into, read_scattered
from ._convert import aligned_empty
from ._errors import CorruptCheckpointError
from ._leaf import KeyRecord, StoredLeaf, check_bool_bytes
from ._manifest import Manifest
from ._pack import packed_array, read_runs, unpack
from ._progress import advance
from ._select import Selection
from ._source import LazyEntry, Source, reading
from ._storage import MAX_ZARR_JSON_BYTES, CheckpointPath, Pin, Storage, corrupt, resolve
from ._window import Task, run_windowed


class Checkpoint(Source):
    """A committed checkpoint: its leaves, their shapes and dtypes, and metadata.

    Nothing is read from the arrays until you ask for values.

    ```python
    ckpt = eqxckpt.open("checkpoints/step_100")
    ckpt.paths                      # ['model/layers/0/weight', ...]
    ckpt.metadata["step"]           # 100
    w = ckpt["model/layers/0/weight"]  # LazyArray: shape and dtype, no data yet
    w.get()                         # numpy array
    ```
    """

    def __init__(self, location: Storage, manifest: Manifest, pin: Pin | None = None):
        self.location = location
        self._arrays = location.arrays(manifest)
        # Leaves an incremental save took unchanged from earlier checkpoints are in theirs.
        self._referenced = {ref: location.referenced(ref) for ref in manifest.references()}
        self._manifest = manifest
        self.metadata = manifest.metadata
        self._leaves = {leaf.path: leaf for leaf in manifest.leaves}
        self._packed = packed_array(manifest.leaves)  # the array small leaves are packed in, if any
        self._pin = pin
        if pin is not None:
            weakref.finalize(self, pin.close)

    def _lazy(self, leaf: StoredLeaf) -> "LazyArray":
        return LazyArray(self, leaf)

    # -- reading -----------------------------------------------------------------

    def _open_array(self, leaf: StoredLeaf) -> ts.Future:
        """Start opening a leaf's stored array: reads its ``zarr.json`` (at most
        `MAX_ZARR_JSON_BYTES`); `_open_checked` validates it and opens the array."""
        return self._arrays_of(leaf).read_leaf_metadata(leaf)

    def _arrays_of(self, leaf: StoredLeaf) -> Storage:
        """Where the leaf's array is: this checkpoint's arrays, or an earlier one's."""
        return self._arrays if leaf.arrays is None else self._referenced[leaf.arrays]

    def _checked_metadata(self, leaf: StoredLeaf, opened: ts.Future) -> dict[str, Any]:
        """The leaf's ``zarr.json`` (being read by ``opened``), checked to be what eqxckpt
        writes for what the manifest says. What was checked is what is used: every read,
        whole or a selection, goes through the layout it gives (`_layout`)."""
        with reading(leaf):
            raw = opened.result()
        if raw is None:
            raise corrupt(leaf, "its zarr.json is missing")
        return validate_array_metadata(raw, leaf)

    def _layout(self, leaf: StoredLeaf) -> ChunkLayout:
        return ChunkLayout.stored(leaf, self._checked_metadata(leaf, self._open_array(leaf)))

    @functools.cached_property
    def _packed_layout(self) -> ChunkLayout:
        """The packed array's layout, its metadata (and its files) checked once for every read of it."""
        assert self._packed is not None
        return self._layout(self._packed)

    def _chunk_reads(
        self, record: StoredLeaf, layout: ChunkLayout, region: Region | None, out: np.ndarray, done: Callable[[], None]
    ) -> Iterator[Task]:
        """Tasks that read the chunks of ``region`` (None: all; chunk-aligned) of ``record``'s
        array into ``out`` (shaped like it), checking each one's checksum, then call ``done``.
        Made as the window takes them: a read that fails stops before the rest are made."""
        box = tuple(range(n) for n in layout.shape) if region is None else tuple(range(s.start, s.stop) for s in region)
        yield from self._selection_reads(record, layout, box, out, done)

    def _selection_reads(
        self, record: StoredLeaf, layout: ChunkLayout, box: Sequence[range], out: np.ndarray, done: Callable[[], None]
    ) -> Iterator[Task]:
        """Tasks that read the elements ``box`` selects (`ChunkLayout.parts`) of ``record``'s
        array into ``out`` (shaped like ``box``), each chunk once, then call ``done``."""
        files = self._arrays_of(record).chunk_files()
        task: Task | None = None
        for key, part, take, put in layout.parts(box):
            if task is not None:
                yield task
            into = out[(*put, ...)]  # a view, even 0-d

            def work(key: str = key, part: Region = part, take: Region = take, into: np.ndarray = into) -> None:
                with reading(record):
                    read_into(files, f"{record.path}/{key}", layout, part, take, into)

            task = (math.prod(s.stop - s.start for s in part) * layout.dtype.itemsize, work, None)
        last: Task = (0, lambda: None, None) if task is None else task
        yield (last[0], last[1], lambda _: done())  # the last one settles after all the others

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        """Read each of ``leaves`` whole, as stored, calling ``done(i, data)`` in order: all
        their metadata at once, then their chunks straight into the final buffers within a
        `read_window`. Packed leaves are read as runs of the packed array's chunks, each once."""
        own = [i for i, leaf in enumerate(leaves) if leaf.offset is None]
        packed = [i for i, leaf in enumerate(leaves) if leaf.offset is not None]
        opens = [self._open_array(leaves[i]) for i in own]
        layouts = {i: ChunkLayout.stored(leaves[i], self._checked_metadata(leaves[i], o)) for i, o in zip(own, opens)}
        runs = []
        if packed:
            assert self._packed is not None  # a bad chunk names the packed array; verify names its leaves
            runs = read_runs([leaves[i] for i in packed], self._packed.shape[0], self._packed_layout.chunk[0])
        # Reserved once the files were checked: those must hold what the manifest declares.
        reserve(sum(leaves[i].nbytes for i in own) + sum(end - start for start, end, _ in runs))

        def tasks() -> Iterator[Task]:  # buffers made as the window takes their first chunk
            for i in own:
                layout = layouts[i]
                buffer = aligned_empty(layout.shape, layout.dtype)  # aligned: the jax array adopts it
                yield from self._chunk_reads(leaves[i], layout, None, buffer, lambda i=i, b=buffer: done(i, b))
            if packed:
                assert self._packed is not None
                layout = self._packed_layout
                for start, end, members in runs:
                    indices = [packed[m] for m in members]
                    buffer = aligned_empty((end - start,), np.dtype(np.uint8))

                    def unpacked(start: int = start, buffer: np.ndarray = buffer, indices: list[int] = indices) -> None:
                        for i, data in zip(indices, unpack(buffer, start, [leaves[i] for i in indices])):
                            done(i, data)

                    yield from self._chunk_reads(self._packed, layout, (slice(start, end),), buffer, unpacked)

        run_windowed(tasks(), read_window(sum(leaf.nbytes for leaf in leaves)))

    def _stored(self, leaf: StoredLeaf) -> np.ndarray:
        """One leaf's stored array, read whole."""
        found: list[np.ndarray] = []
        reserve = lambda nbytes: check_allocation(nbytes, f"Reading leaf {leaf.path!r}")  # noqa: E731
        self._fetch([leaf], lambda _, data: found.append(data), reserve)
        return found[0]

    def _selected(self, leaf: StoredLeaf, selection: Selection, layout: ChunkLayout | None = None) -> np.ndarray:
        """The elements ``selection`` takes of a leaf with its own array: only the chunks
        holding them are read, each checked as a whole read checks it. ``layout``: the
        leaf's, if it was checked already."""
        layout = self._layout(leaf) if layout is None else layout
        box = selection.box()
        assert len(box) == len(layout.shape), (box, layout.shape)
        nbytes = math.prod(len(r) for r in box) * layout.dtype.itemsize
        check_allocation(nbytes, f"Reading leaf {leaf.path!r}")
        out = np.empty(tuple(len(r) for r in box), layout.dtype)
        run_windowed(self._selection_reads(leaf, layout, box, out, lambda: None), read_window(nbytes))
        return selection.finish(out)

    def _read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        """Read every selected leaf (see `Source._read` and `_fetch`). A target whose sharding
        spans several devices is read block by block instead (`BlockReads`)."""
        sharded = {i for i, (leaf, target) in enumerate(wanted) if leaf.offset is None and _sharded(leaf, target)}
        whole = [i for i in range(len(wanted)) if i not in sharded]
        values: list[Any] = [None] * len(wanted)
        for i, value in zip(whole, super()._read([wanted[i] for i in whole])):
            values[i] = value
        # Sharded targets last, a leaf at a time, each block placed on its devices before it
        # is let go: the host holds the reads' window and the blocks being filled.
        window = read_window(sum(leaf.nbytes for leaf, _ in wanted))
        for i in sorted(sharded):
            leaf, target = wanted[i]
            # Planned outside `reading`: a sharding that does not fit the shape is the
            # caller's mistake (JAX's own error), not a damaged checkpoint.
            blocks = BlockReads(self, leaf, target, window)
            with reading(leaf):
                values[i] = leaf.assemble(target, blocks, lambda index, shape=leaf.shape: _slice_key(index, shape))
            advance(leaf.nbytes)
        return values


def _sharded(leaf: StoredLeaf, target: Any) -> bool:
    """Whether to read ``target`` block by block: each device's block, on its process."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or (len(sharding.device_set) == 1 and sharding.is_fully_addressable):
        return False
    return leaf.can_shard(sharding)


def _slice_key(index: tuple, shape: tuple[int, ...]) -> tuple:
    """A hashable, normalised form of an index into ``shape``."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class BlockReads:
    """The blocks of one leaf that this process's devices hold (one per distinct slice:
    replicas share theirs), handed to the assembly in the order it asks for them.

    Blocks are read in groups: every chunk that a group's blocks need is read once (its
    checksum checked), within the window, and its part of each block copied in; then each
    block is put on its devices and let go. A block for CPU devices becomes the result
    itself (`jax.device_put` keeps an aligned host buffer), so those are all one group,
    however the leaf is split. Blocks for other devices are staged in host memory: a group
    holds at most the host memory budget (at least one block), and its reads in flight what
    is left of it, so a leaf split by columns, whose every chunk holds part of every block,
    is read once per group.
    """

    def __init__(self, checkpoint: Checkpoint, leaf: StoredLeaf, target: Any, window: int):
        self._checkpoint, self._leaf = checkpoint, leaf
        self._layout = layout = checkpoint._layout(leaf)
        self._trailing = layout.shape[len(leaf.shape) :]  # a PRNG key's key data: whole in every block
        devices: dict[tuple, list[Any]] = {}
        for device, index in target.sharding.addressable_devices_indices_map(leaf.shape).items():
            devices.setdefault(_slice_key(index, leaf.shape), []).append(device)
        self._uses = {key: len(on) for key, on in devices.items()}  # slices still to hand over
        self._group: dict[tuple, int] = {}
        groups: list[list[tuple]] = [[]]
        staged, budget = [0], host_memory_budget()
        for key, on in devices.items():
            cost = 0 if all(device.platform == "cpu" for device in on) else self._nbytes(key)
            if groups[-1] and staged[-1] + cost > budget:
                groups.append([])
                staged.append(0)
            groups[-1].append(key)
            staged[-1] += cost
            self._group[key] = len(groups) - 1
        self._groups = groups
        # A group's reads in flight: what its staged blocks leave of the budget (one at least).
        self._windows = [min(window, max(1, budget - nbytes)) for nbytes in staged]
        self._held: dict[tuple, np.ndarray] = {}

    def _nbytes(self, key: tuple) -> int:
        return math.prod(stop - start for start, stop in key) * math.prod(self._trailing) * self._layout.dtype.itemsize

    def __getitem__(self, key: tuple) -> np.ndarray:
        if key not in self._held:
            group = self._group[key]
            self._read(self._groups[group], self._windows[group])
        data = self._held[key]
        self._uses[key] -= 1
        if not self._uses[key]:  # on every device that holds it: let it go
            del self._held[key]
        return data

    def _read(self, keys: list[tuple], window: int) -> None:
        """Fill the blocks ``keys``, reading each chunk they need once."""
        layout, leaf = self._layout, self._leaf
        files = self._checkpoint._arrays_of(leaf).chunk_files()
        blocks = {}
        for key in keys:  # aligned: on a CPU device the jax array keeps the buffer
            blocks[key] = aligned_empty(tuple(b - a for a, b in key) + self._trailing, layout.dtype)
        wanted: dict[str, tuple[Region, list[tuple[np.ndarray, Region, Region]]]] = {}
        for key in keys:
            box = (*(range(a, b) for a, b in key), *(range(n) for n in self._trailing))
            for chunk, part, take, put in layout.parts(box):
                wanted.setdefault(chunk, (part, []))[1].append((blocks[key], take, put))

        def work(chunk: str, part: Region, into: list[tuple[np.ndarray, Region, Region]]) -> None:
            with reading(leaf):  # chunks fill disjoint parts of a block: threads may share it
                # ``b[(*put, ...)]``: a view even of a 0-d block (``b[()]`` is a scalar, not writable).
                views = [(take, b[(*put, ...)]) for b, take, put in into]
                read_scattered(files, f"{leaf.path}/{chunk}", layout, part, views)

        order = sorted(wanted.items(), key=lambda item: tuple(s.start for s in item[1][0]))  # C order: sequential
        itemsize = layout.dtype.itemsize
        tasks = (
            (math.prod(s.stop - s.start for s in part) * itemsize, functools.partial(work, c, part, into), None)
            for c, (part, into) in order
        )
        run_windowed(tasks, window)
        self._held.update(blocks)


_ZARR_KEYS = {
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "fill_value",
    "codecs",
    "attributes",
    "dimension_names",
    "storage_transformers",
}


def validate_array_metadata(raw: bytes, record: StoredLeaf) -> dict[str, Any]:
    """A leaf's ``zarr.json``, checked against what eqxckpt writes for ``record``.

    Only the codec chain eqxckpt writes (raw little-endian bytes plus a crc32c
    checksum), a zero fill value, and a regular grid of chunks of at most
    `CHUNK_BYTES` and at most `ChunkLayout.max_count` of them are accepted, so a
    crafted file can neither skip the checksum, nor make a read allocate more than
    the array's own size plus one chunk, nor cut a leaf into a million chunks. Every
    read (whole, lazy selection, sharded, `verify`) goes through this one check.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"Leaf {record.path!r}: its zarr.json {why}. eqxckpt never writes that: the checkpoint is damaged or "
            "crafted; do not trust it.",
            leaf_path=record.path,
        )

    if len(raw) > MAX_ZARR_JSON_BYTES:
        raise bad(f"is over {MAX_ZARR_JSON_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad("is not valid JSON") from None
    if not isinstance(doc, dict):
        raise bad("is not a JSON object")
    if extra := sorted(set(doc) - _ZARR_KEYS):
        raise bad(f"has fields {extra}")
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise bad("does not describe a zarr v3 array")
    shape = record.data_shape
    if doc.get("shape") != list(shape) or doc.get("data_type") != record.dtype:
        raise CorruptCheckpointError(
            f"Leaf {record.path!r} is corrupt: the manifest says {record.dtype}{list(shape)} but its zarr.json says "
            f"{doc.get('data_type')}{doc.get('shape')}. Restore the checkpoint from a copy or load an earlier one.",
            leaf_path=record.path,
        )
    grid = doc.get("chunk_grid")
    chunk = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) else None
    if not (
        isinstance(grid, dict)
        and grid.get("name") == "regular"
        and isinstance(chunk, list)
        and len(chunk) == len(shape)
        and all(isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= max(1, n) for c, n in zip(chunk, shape))
    ):
        raise bad(f"has a chunk grid {grid!r} that does not fit the shape {list(shape)}")
    if math.prod(chunk) * np.dtype(record.dtype).itemsize > CHUNK_BYTES:
        raise bad(f"has chunks of {chunk} (over {CHUNK_BYTES} bytes)")
    layout = ChunkLayout.stored(record, {"chunk_grid": grid})
    if layout.count > layout.max_count:  # each chunk costs a file, a read and a task, whatever its size
        raise bad(
            f"splits its {record.nbytes} bytes into {layout.count} chunks of {chunk} (at most {layout.max_count} "
            "are accepted: one per 4 KiB, or 65536)"
        )
    if not _is_zero(doc.get("fill_value", None), record.dtype):
        raise bad(f"has a fill_value of {doc.get('fill_value', '(none)')!r}, not the zero eqxckpt writes")
    encoding = doc.get("chunk_key_encoding")
    if encoding not in ({"name": "default"}, {"name": "default", "configuration": {"separator": "/"}}):
        raise bad(f"has a chunk key encoding {encoding!r}")
    codecs = doc.get("codecs")
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    if not (
        isinstance(codecs, list)
        and len(codecs) == 2
        and codecs[1] == {"name": "crc32c"}
        and (codecs[0] == little or (codecs[0] == {"name": "bytes"} and np.dtype(record.dtype).itemsize == 1))
    ):
        raise bad(f"has codecs {codecs!r}, not raw bytes with a crc32c checksum")
    if doc.get("storage_transformers", []) != []:
        raise bad("has storage transformers")
    return {
        key: doc[key]
        for key in ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs", "fill_value")
        if key in doc
    }


def _is_zero(value: Any, dtype: str) -> bool:
    """Whether ``value`` is a zarr ``fill_value`` of zero for ``dtype``, as eqxckpt and
    TensorStore write it (``0``, ``0.0``, ``false``, ``[0.0, 0.0]``)."""

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0

    if dtype == "bool":
        return value is False
    if dtype.startswith("complex"):
        return isinstance(value, list) and len(value) == 2 and all(number(x) for x in value)
    if np.dtype(dtype).kind in "iu":
        return number(value) and isinstance(value, int)
    return number(value)


class LazyArray(LazyEntry):
    """One stored array: ``shape``, ``dtype`` and ``nbytes`` now, data on ``get()``.

    Indexing (``lazy[0, :4]``) and ``astype`` are deferred too, so only the
    selected elements are ever read.

    ```python
    w = eqxckpt.open("ckpt")["model/w"]
    w.shape, w.dtype          # no I/O beyond the manifest
    w[:2].astype("float32").get()
    ```
    """

    source: Checkpoint

    def __init__(self, checkpoint: Checkpoint, leaf: StoredLeaf, index: Any = (), dtype: Any = None):
        super().__init__(checkpoint, leaf)
        self._index = index
        self._indexed = not (isinstance(index, tuple) and not index)  # compared without ==: numpy ints
        self._dtype = None if dtype is None else np.dtype(dtype)

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint this array belongs to.

        **Returns:** the `Checkpoint` it was read from.

        ```python
        lazy.checkpoint.metadata
        ```
        """
        return self.source

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of what `get` returns (after any indexing).

        **Returns:** a tuple of ints.

        ```python
        ckpt["model/w"][:2].shape  # (2, 3)
        ```
        """
        shape = self.leaf.shape
        if not self._indexed:
            return shape
        return Selection.of(self._index, shape).shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype of what `get` returns (after any `astype`; ``key<impl>`` for PRNG keys).

        **Returns:** a numpy dtype.

        ```python
        ckpt["model/w"].astype("float16").dtype  # dtype('float16')
        ```
        """
        return self._dtype if self._dtype is not None else self.leaf.value_dtype

    @property
    def nbytes(self) -> int:
        """Bytes `get` returns (for PRNG keys: their key data).

        **Returns:** an int.

        ```python
        sum(ckpt[p].nbytes for p in ckpt.paths if p.startswith("model/"))
        ```
        """
        return self.leaf.selection_nbytes(self.shape, self.dtype)

    def __getitem__(self, index: Any) -> "LazyArray":
        """A lazy selection: only the selected elements are read on `get`.

        **Arguments:**

        - `index`: a basic numpy index (ints, slices, ``...``, ``None``), applied once.

        **Returns:** a `LazyArray`. An index out of range raises numpy's `IndexError`
        now; arrays and masks raise `NotImplementedError` (index what `get` returns).

        ```python
        first_rows = ckpt["model/embedding"][:16].get()
        ```
        """
        if self._indexed:
            raise NotImplementedError("Index a LazyArray once; combine the indices into one expression.")
        if not self.leaf.sliceable:
            raise NotImplementedError(
                f"Leaf {self.leaf_path!r} ({self.leaf.describe()}) cannot be sliced lazily; get() the whole array."
            )
        Selection.of(index, self.leaf.shape)  # refused now, not when read
        return LazyArray(self.source, self.leaf, index, self._dtype)

    def astype(self, dtype: Any) -> "LazyArray":
        """A lazy cast: the conversion happens on ``get()``.

        **Arguments:**

        - `dtype`: the dtype to convert to (numpy's conversion rules).

        **Returns:** a `LazyArray`.

        ```python
        w = ckpt["model/w"].astype("float32").get()
        ```
        """
        return LazyArray(self.source, self.leaf, self._index, dtype)

    def _stream(self) -> "SelectionStream | np.ndarray":
        """What to copy this array (indexed and cast as it is) from a part at a time,
        without reading it all into memory; a packed leaf (small) is read whole."""
        if self.leaf.offset is not None:
            with reading(self.leaf):
                data = self._data()
            return data if self._dtype is None else data.astype(self._dtype)
        # The stored shape: a PRNG key array (never indexed) is copied as its key data.
        return SelectionStream(self.source, self.leaf, Selection.of(self._index, self.leaf.data_shape), self._dtype)

    def _saved_as(self, path: str, keys: tuple[KeyRecord, ...]) -> StoredLeaf:
        """The leaf this array becomes when it is saved at ``path`` (copied from its checkpoint)."""
        changed = self._indexed or self._dtype is not None
        return self.leaf.copied(path, keys, tuple(self.shape), self.dtype, changed=changed)

    def _data(self) -> np.ndarray:
        """The selected stored values: the whole leaf read chunk by chunk (a packed one from
        the chunks holding it), a selection from only the chunks holding it, through the
        same reader and checks."""
        if self.leaf.offset is None and self._indexed:
            return self.source._selected(self.leaf, Selection.of(self._index, self.leaf.shape))
        data = self.source._stored(self.leaf)
        check_bool_bytes(data, self.leaf.path)  # all of it: a selection could skip a damaged byte
        return data[self._index] if self._indexed else data

    def get(self) -> Any:
        """Read the data.

        **Returns:** a numpy array (a jax key array for PRNG keys).

        ```python
        w = eqxckpt.open("ckpt")["model/w"].get()
        ```
        """
        with self.source.consistent(), reading(self.leaf):
            data = self._data()
        return self.leaf.host_value(data, self._dtype)

    async def get_async(self) -> Any:
        """Read without blocking the event loop.

        **Returns:** as for `get`.

        ```python
        w = await ckpt["model/w"].get_async()
        ```
        """
        return await asyncio.to_thread(self.get)


class SelectionStream:
    """A lazy selection of a leaf with its own array, to copy from a part at a time:
    ``stream[part]`` (slices from 0) reads only the chunks that part needs."""

    def __init__(self, checkpoint: Checkpoint, leaf: StoredLeaf, selection: Selection, dtype: np.dtype | None):
        self._checkpoint, self._leaf, self._selection, self._dtype = checkpoint, leaf, selection, dtype

    @functools.cached_property
    def _layout(self) -> ChunkLayout:  # checked once, not once per part
        return self._checkpoint._layout(self._leaf)

    def __getitem__(self, part: Region) -> np.ndarray:
        with reading(self._leaf):
            layout = self._layout
        data = self._checkpoint._selected(self._leaf, self._selection.sub(part), layout)
        return data if self._dtype is None else data.astype(self._dtype)


def open_checkpoint(path: CheckpointPath | Storage) -> Checkpoint:
    """An eqxckpt checkpoint, opened read-only without reading any array (`eqxckpt.open` for this format)."""
    location = resolve(path)
    manifest, pin = location.read_manifest()
    return Checkpoint(location, manifest, pin)
